#!/usr/bin/env python
"""Where a batch-1 decode token goes on CPU, with wall-clock timers instead of a profiler (whose
per-op cost distorts a ~10-15 ms step of ~1,000 ops): an offline Engine generates one request
(256 random prompt tokens, then ``--output-len`` greedy tokens over the cached prompt, so nearly
every step is a decode), timing the engine step, the model's forward, its decoder layers, the
quantized linears (the module and the kernel inside it), cpu_paged's attention (the backend's
forward and the decode kernel inside it) and the LM head. Engine settings pass through as
``name=value`` (e.g. ``quantization=gguf kv_cache_dtype=float16``); with
``enable_torch_compile=true`` the parts traced into the compiled step are not timed.

    .venv/bin/python bench/cpu_step_parts.py quantization=gguf kv_cache_dtype=float16
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from radixserve import Engine
from radixserve.core import engine_core
from radixserve.plugins.attention.cpu_paged import backend as cpu_paged
from radixserve.plugins.models import decoder, quant

TOTALS: Counter[str] = Counter()
CALLS: Counter[str] = Counter()
TIMING = [False]  # only the measured request is timed


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not TIMING[0]:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        TOTALS[name] += time.perf_counter() - start
        CALLS[name] += 1
        return out

    return wrapper


def instrument() -> None:
    parts: list[tuple[Any, str, str]] = [
        (engine_core.EngineCore, "step", "engine step"),
        (decoder.DecoderForCausalLM, "forward", "model forward"),
        (decoder.DecoderLayer, "forward", "decoder layers"),
        (quant.QuantizedLinear, "forward", "quantized linears"),
        (quant.ScreenedHead, "forward", "LM head (screened)"),
        (cpu_paged.CpuPagedAttention, "forward", "attention forward"),
        (cpu_paged.CpuPagedAttention, "_decodes", "decode attention"),
    ]
    for cls in (quant.Q4BlockLinear, quant.Int4Linear, quant.Int8Linear):
        parts.append((cls, "matmul", "quantized kernels"))
    for cls, attr, name in parts:
        setattr(cls, attr, timed(name, getattr(cls, attr)))


def setting(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    if not value:
        raise argparse.ArgumentTypeError(f"expected name=value, got {text!r}")
    lowered = value.lower()
    return name, {"true": True, "false": False}.get(lowered, value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("settings", nargs="*", type=setting, help="engine settings, name=value")
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args()
    settings = dict(args.settings)
    instrument()
    engine = Engine(**settings)
    try:
        rng = random.Random(0)
        prompt = [rng.randint(100, 40000) for _ in range(256)]
        greedy = {"temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 8})
        TIMING[0] = True
        start = time.perf_counter()
        params = {**greedy, "max_new_tokens": args.output_len + 1}  # the first: a cache hit
        engine.generate(input_ids=prompt, sampling_params=params)
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    n = args.output_len
    print(f"{settings}, threads={torch.get_num_threads()}: {wall / n * 1e3:.2f} ms a token")
    for name, seconds in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
        print(f"  {name:20} {seconds / n * 1e3:6.2f} ms a token ({CALLS[name] / n:.0f} calls)")


if __name__ == "__main__":
    main()
