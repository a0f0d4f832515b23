#!/usr/bin/env python
"""Where a batch-1 decode token goes on CPU, with wall-clock timers instead of a profiler (whose
per-op cost distorts a ~25 ms step of ~2,300 ops): an offline Engine generates one request
(256 random prompt tokens, 128 greedy tokens, after a warm-up request), timing every call of
the quantized linears' kernel (``--quantization``) and of cpu_paged's decode attention.

    .venv/bin/python bench/cpu_step_parts.py --quantization gguf
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from radixserve import Engine
from radixserve.plugins.attention.cpu_paged import backend as cpu_paged
from radixserve.plugins.models import quant

TOTALS: dict[str, float] = {}


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        TOTALS[name] = TOTALS.get(name, 0.0) + time.perf_counter() - start
        return out

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    for cls in (quant.Q4BlockLinear, quant.Int4Linear, quant.Int8Linear):
        cls.matmul = timed("quantized linears", cls.matmul)  # type: ignore[method-assign]
    attention = cpu_paged.CpuPagedAttention
    attention._decodes = timed("decode attention", attention._decodes)  # type: ignore[method-assign]
    engine = Engine(quantization=args.quantization)
    try:
        rng = random.Random(0)
        prompt = [rng.randint(100, 40000) for _ in range(256)]
        params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prompt, sampling_params=params)  # warm-up
        TOTALS.clear()
        start = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params=params)
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    n = args.output_len
    print(f"--quantization {args.quantization}, threads={torch.get_num_threads()}: "
          f"{wall / n * 1e3:.2f} ms a token (prefill included)")  # fmt: skip
    for name, seconds in TOTALS.items():
        print(f"  {name:18} {seconds / n * 1e3:6.2f} ms a token")


if __name__ == "__main__":
    main()
