#!/usr/bin/env python
"""Weight formats on CPU against float32: greedy agreement, perplexity, batch-1 decode step.

For each format (``--formats``: float32 first, the reference, then e.g. bfloat16, int8wo,
int4wo) one offline Engine on the default model (or ``--model``):

- agreement: 64 prompts (8 instructions x 8 topics) x 64 greedy tokens (EOS ignored), compared
  with float32's position by position: the share of identical tokens, of prompts identical in
  full, and the mean length of the common prefix;
- perplexity of ``data/perplexity.txt`` beside this file (the opening of Pride and Prejudice, public
  domain) from the prompt's own logprobs;
- the median batch-1 decode step (a 256-token random prompt, 64 tokens), load-dependent: read
  it as a ratio to float32's in the same run, and only on a quiet machine.

    .venv/bin/python bench/cpu_formats.py --json-out bench/results/cpu-formats.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from common import machine_info, num_cores, random_prompts, special_token_ids, write_json

from radixserve import Engine, hookimpl
from radixserve.core.plugins import PluginHost

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
INSTRUCTIONS = [
    "Write a short story about {}.",
    "Explain {} to a ten-year-old.",
    "List three facts about {}.",
    "Write a haiku about {}.",
    "What is the history of {}?",
    "Give me advice about {}.",
    "Describe {} in one paragraph.",
    "Why do people like {}?",
]
TOPICS = ["the sea", "mountains", "coffee", "trains", "music", "gardening", "the moon", "chess"]
#: format name -> Engine settings
FORMATS: dict[str, dict[str, str]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8wo": {"dtype": "float32", "quantization": "int8wo"},
    "int4wo": {"dtype": "float32", "quantization": "int4wo"},
    "w8a8_int8": {"dtype": "float32", "quantization": "w8a8_int8"},
    "gguf": {"dtype": "float32", "quantization": "gguf"},
    "float32+f16kv": {"dtype": "float32", "kv_cache_dtype": "float16"},
    "gguf+f16kv": {"dtype": "float32", "quantization": "gguf", "kv_cache_dtype": "float16"},
    "bfloat16+int8wo": {"dtype": "bfloat16", "quantization": "int8wo"},
    "bfloat16+int4wo": {"dtype": "bfloat16", "quantization": "int4wo"},
}


class DecodeSteps:
    """Step times of decode-only steps (the engine's step_finished hook)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    @hookimpl
    def step_finished(self, stats: dict[str, Any]) -> None:
        if not stats["num_prefill_tokens"]:
            self.times.append(float(stats["step_time_s"]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the engine's default)")
    p.add_argument("--formats", default="float32,bfloat16,int8wo,int4wo", help="comma-separated")
    p.add_argument("--output-len", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=num_cores(), help="torch threads")
    p.add_argument(
        "--max-running",
        type=int,
        default=8,
        help="requests decoding at once for the agreement run (below 16 rows the quantized "
        "formats decode on their kernels, as a few users would; 16+ use the dense copies)",
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    args.formats = args.formats.split(",")
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown or args.formats[0] != "float32":
        p.error(f"--formats: float32 first, then any of {', '.join(FORMATS)} (got {unknown})")
    return args


def perplexity(engine: Engine, text: str) -> tuple[float, int]:
    out = engine.generate(text, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    logprobs = [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]
    return math.exp(-statistics.fmean(logprobs)), len(logprobs)


def run_format(name: str, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    steps = DecodeSteps()
    host = PluginHost(extra_plugins=[("bench-decode-steps", steps)])
    t0 = time.perf_counter()
    engine = Engine(
        model_path=args.model,
        host=host,
        max_total_tokens=16384,
        max_running_requests=args.max_running,
        **FORMATS[name],
    )
    start_s = time.perf_counter() - t0
    try:
        greedy = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        outputs = [o["output_ids"] for o in engine.generate(prompts, greedy)]
        ppl, scored = perplexity(engine, TEXT.read_text())
        vocab = engine.core.runner.model_config.vocab_size
        prompt = random_prompts(1, 256, vocab, special_token_ids(engine.model_dir), seed=0)
        steps.times = []
        engine.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 64})
    finally:
        engine.shutdown()
    return {
        "format": name,
        "settings": FORMATS[name],
        "start_s": start_s,
        "outputs": outputs,
        "perplexity": ppl,
        "perplexity_tokens": scored,
        "b1_decode_step_ms": 1e3 * statistics.median(steps.times[4:]),
    }


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    same = sum(a == b for r, o in zip(ref, other, strict=True) for a, b in zip(r, o, strict=True))
    total = sum(map(len, ref))
    prefixes = []
    for r, o in zip(ref, other, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
        prefixes.append(n)
    return {
        "identical_token_share": same / total,
        "identical_prompt_share": sum(p == len(r) for p, r in zip(prefixes, ref, strict=True))
        / len(ref),
        "mean_common_prefix": statistics.fmean(prefixes),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info()
    prompts = [i.format(t) for i in INSTRUCTIONS for t in TOPICS]
    results = [run_format(name, args, prompts) for name in args.formats]
    ref = results[0]
    header = (
        f"{'format':<18} {'same tokens':>11} {'same prompts':>12} {'common prefix':>13} "
        f"{'perplexity':>10} {'b1 step ms':>10} {'vs float32':>10}"
    )
    print(f"{len(prompts)} prompts x {args.output_len} greedy tokens; threads={args.threads}")
    print(header)
    for r in results:
        r["agreement"] = agreement(ref["outputs"], r["outputs"])
        a = r["agreement"]
        speed = ref["b1_decode_step_ms"] / r["b1_decode_step_ms"]
        print(
            f"{r['format']:<18} {a['identical_token_share']:>11.1%} "
            f"{a['identical_prompt_share']:>12.1%} {a['mean_common_prefix']:>13.1f} "
            f"{r['perplexity']:>10.3f} {r['b1_decode_step_ms']:>10.2f} {speed:>9.2f}x"
        )
    if args.json_out:
        payload = {
            "benchmark": "cpu_formats",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {**machine, "load_avg_1m_end": os.getloadavg()[0]},
            "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results],
        }
        write_json(args.json_out, payload)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
