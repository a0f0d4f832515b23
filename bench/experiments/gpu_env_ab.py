#!/usr/bin/env python
"""A-B-A-B of an environment switch read at engine start, on bench/gpu.py's 64 x (1,024 + 256)
workload with its tuned engine, in one process (issue 18): fresh machines differ by more than
the changes measured here, so the two settings alternate on one machine. Each round builds a
fresh engine per value, warms it up at the workload's shapes and times it (overlap on); the
decode-only steps' median comes from the ``step_finished`` stats.

    python bench/experiments/gpu_env_ab.py --env RADIXSERVE_ROPE_IN_ATTENTION --values 1 0 \
        --rounds 2
    python bench/experiments/gpu_env_ab.py --env=--chunked-prefill-size --values 8192 65536

An ``--env`` that starts with ``--`` names one of the tuning flags instead (bench/gpu.py's
``add_tuning_flags``), set to each value in turn.

It measured the skinny GEMM of issue 18 (RADIXSERVE_TRITON_SKINNY, no longer
in the model) as no gain: 7.21 against 7.19 ms a decode step (bench/HISTORY.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import format_table, machine_info, write_json
from gpu import (
    StepStats,
    add_tuning_flags,
    bench_host,
    ceilings,
    prompts,
    run_generate,
    tuned_engine,
    workload_bound_tok_s,
)
from gpu_model import SHAPES, write_random_llama

WORKLOAD = (64, 1024, 256)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", required=True,
                   help="an environment variable, or a tuning flag: --page-size")  # fmt: skip
    p.add_argument("--values", nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--workdir", default=None)
    p.add_argument("--json-out", default=None)
    add_tuning_flags(p)
    return p.parse_args()


def one_run(model_dir: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    stats = StepStats()
    engine = tuned_engine(model_dir, args, [WORKLOAD], bench_host(stats))
    try:
        vocab = SHAPES[args.shape]["vocab_size"]
        n, prompt, out = WORKLOAD
        run_generate(engine, prompts(n, prompt, vocab, seed - 1), out // 8)  # as warm_and_time
        stats.steps.clear()
        seconds = run_generate(engine, prompts(n, prompt, vocab, seed), out)
        decode = [s["step_time_s"] for s in stats.steps if s["num_prefill_tokens"] == 0]
        prefill = [s["step_time_s"] for s in stats.steps if s["num_prefill_tokens"] > 0]
        return {"tok_s": n * out / seconds, "decode_median_ms": 1e3 * statistics.median(decode),
                "prefill_steps": len(prefill), "prefill_s": sum(prefill)}
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def set_value(args: argparse.Namespace, value: str) -> None:
    """``--env``'s variable, or its tuning flag (``--page-size``), set to ``value``."""
    if not args.env.startswith("--"):
        os.environ[args.env] = value
        return
    name = args.env[2:].replace("-", "_")
    if not hasattr(args, name):
        raise SystemExit(f"--env {args.env}: not one of bench/gpu.py's tuning flags")
    setattr(args, name, type(getattr(args, name))(value))


def main() -> int:
    args = parse_args()
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info(), "runs": []}
    # the ceilings of this machine, now: every run's share of the workload's bound uses them
    res["ceilings"] = ceil = ceilings()
    res["bound_tok_s"] = bound = workload_bound_tok_s(
        args.shape, WORKLOAD, WORKLOAD[0], ceil["copy_GBps"], ceil["matmul_TFLOPs"]
    )
    print(f"ceilings {ceil}, workload bound {bound:.0f} tok/s", flush=True)
    model_dir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-ab-")) / args.shape
    if not (model_dir / "config.json").exists():
        write_random_llama(model_dir, args.shape, "cuda")
    for rnd in range(args.rounds):
        for value in args.values:
            set_value(args, value)
            run = {"round": rnd, "value": value, **one_run(model_dir, args, 50 + 2 * rnd)}
            run["of_bound"] = run["tok_s"] / bound
            res["runs"].append(run)
            print(run, flush=True)
            if args.json_out:
                write_json(args.json_out, res)
    rows = []
    for value in args.values:
        mine = [r for r in res["runs"] if r["value"] == value]
        rows.append([value, *(f"{r['tok_s']:.0f} ({r['of_bound']:.3f})" for r in mine),
                     statistics.median(r["decode_median_ms"] for r in mine),
                     statistics.median(r["prefill_s"] for r in mine)])  # fmt: skip
    head = [args.env, *(f"round {i} tok/s" for i in range(args.rounds)), "decode step ms",
            "prefill steps s"]
    print(format_table(head, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
