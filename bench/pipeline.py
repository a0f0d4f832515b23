#!/usr/bin/env python
"""Pipeline parallelism in one run: PP1 against PPn (default 2) throughput on the same workload
(default 64 requests of 64 random prompt tokens, 64 greedy output tokens each, EOS ignored), and
each stage's bubble fraction (idle time / wall time over its steps).

The model is a random-weight Llama written once per run (``--shape``: ``cpu-small``, 8 layers
of hidden 512, for the CPU; ``llama3-8b`` etc. from bench/gpu_model.py on GPUs). Each
configuration runs in the same process, one after the other, after a short warm-up with other
prompts (no prefix of the timed prompts is cached). The rates are output tokens / wall time,
prefill included. The bubble comes from each stage's ``PipelineStep.stats`` (busy = time in the
stage's layers, wall = its first step's start to its last step's end, the warm-up included),
gathered by rank 0 when the engine shuts down.

    python bench/pipeline.py --device cpu --json-out bench/results/pipeline-cpu.json
    python bench/pipeline.py --device cuda --shape llama3-8b --pp 2 --tp 1   # 2 GPUs
    python bench/pipeline.py --device cuda --shape llama3-8b --pp 2 --tp 2   # 4 GPUs
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import format_table, machine_info, write_json
from gpu_model import SHAPES, write_random_llama

SHAPES.setdefault(
    "cpu-small",
    dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=8192, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
)  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="cpu-small", choices=sorted(SHAPES))
    p.add_argument("--pp", type=int, default=2, help="the pipeline stages compared with PP1")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of every stage")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--workdir", default=None, help="where the model directory is written")
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def run_config(model_dir: Path, args: argparse.Namespace, tp: int, pp: int) -> dict[str, Any]:
    from radixserve import Engine

    settings: dict[str, Any] = {
        "tp_size": tp,
        "pp_size": pp,
        "max_total_tokens": args.requests * (args.input_len + args.output_len) + 1024,
        "max_running_requests": args.requests,
    }
    if args.device == "cpu":
        settings.update(dtype="float32", plugins=("hardware=cpu",))
    vocab = SHAPES[args.shape]["vocab_size"]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    engine = Engine(str(model_dir), **settings)
    try:
        warm = prompts(args.requests, args.input_len, vocab, seed=1)
        engine.generate(input_ids=warm, sampling_params={**greedy, "max_new_tokens": 4})
        batch = prompts(args.requests, args.input_len, vocab, seed=2)
        start = time.perf_counter()
        out = engine.generate(
            input_ids=batch, sampling_params={**greedy, "max_new_tokens": args.output_len}
        )
        seconds = time.perf_counter() - start
        ranks = engine.core.runner.ranks
    finally:
        engine.shutdown()
    tokens = sum(len(r["output_ids"]) for r in out)
    stages = [
        {**s, "bubble": 1.0 - s["busy_s"] / s["wall_s"] if s["wall_s"] else None}
        for s in ranks.pipeline_stats
    ]
    del engine, ranks
    gc.collect()
    return {
        "tp": tp, "pp": pp, "seconds": seconds, "output_tokens": tokens,
        "tok_s": tokens / seconds, "stages": stages,
        "bubble": max((s["bubble"] for s in stages), default=None),
    }  # fmt: skip


def main() -> int:
    args = parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="radixserve-pp-bench-"))
    model_dir = workdir / args.shape
    if not (model_dir / "config.json").exists():
        write_random_llama(model_dir, args.shape, args.device)
    results = [run_config(model_dir, args, args.tp, 1)]
    results.append(run_config(model_dir, args, args.tp, args.pp))
    base, piped = results
    ratio = piped["tok_s"] / base["tok_s"]
    rows = [
        [f"tp{r['tp']} x pp{r['pp']}", f"{r['tok_s']:.1f}", f"{r['seconds']:.2f}",
         "-" if r["bubble"] is None else f"{r['bubble']:.1%}"]
        for r in results
    ]  # fmt: skip
    print(format_table(["config", "tok/s", "seconds", "bubble (worst stage)"], rows))
    for s in piped["stages"]:
        print(f"  stage {int(s['stage'])}: busy {s['busy_s']:.2f} s of {s['wall_s']:.2f} s, "
              f"bubble {s['bubble']:.1%}")  # fmt: skip
    print(f"PP{args.pp} / PP1 throughput: {ratio:.2f}x")
    if args.json_out:
        write_json(
            args.json_out,
            {"machine": machine_info(), "args": vars(args), "results": results, "ratio": ratio},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
