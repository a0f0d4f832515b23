#!/usr/bin/env python
"""Where the 64 x (1,024 + 256) workload's time goes on CUDA, prefill against decode (issue 18).

With the tuned engine of bench/gpu.py (CUDA graphs, page 1, chunk 8,192):

1. the workload timed as bench/gpu.py times it (overlap on, warmed up at its shapes);
2. again with overlap off, each step's GPU time taken by CUDA events around the model step, so
   the run splits into the steps that carry prefill tokens and the decode-only steps; each part
   is set against its share of ``gpu.workload_bound_tok_s`` (prefill at the matmul ceiling,
   decode at the copy ceiling);
3. the prefill alone (64 x 1,024, one output token) under torch.profiler: kernel GPU time by kind
   and the top kernels, so the prefill gap has a name;
4. decode steps of 64 requests at the workload's mean context under torch.profiler
   (gpu_decode_profile.profile_one).

    python bench/gpu_tput_profile.py --workdir /tmp/models --json-out $OUT/tput-profile.json
"""

from __future__ import annotations

import argparse
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
    warm_and_time,
    workload_bound_tok_s,
)
from gpu_decode_profile import kernel_ms_by_kind, profile_one
from gpu_model import SHAPES, write_random_llama

WORKLOAD = (64, 1024, 256)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--workdir", default=None)
    p.add_argument("--json-out", default=None)
    add_tuning_flags(p)
    return p.parse_args()


class StepTimer:
    """Wraps the runner's model step: CUDA events around each one, labelled prefill (the batch
    carries new prompt tokens) or decode. Read only with overlap off, where each step's work is
    done before the next one is queued."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.inner = runner, runner.step
        self.events: list[tuple[bool, int, Any, Any]] = []
        runner.step = self

    def __getattr__(self, name: str) -> Any:  # graphs, keep_hidden_layers, ...
        return getattr(self.inner, name)

    def __call__(self, fb: Any) -> Any:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = self.inner(fb)
        end.record()
        self.events.append((fb.num_decode < fb.batch_size, fb.num_tokens, begin, end))
        return out

    def split(self) -> dict[str, Any]:
        torch.cuda.synchronize()
        parts: dict[str, Any] = {}
        for name, want in (("prefill", True), ("decode", False)):
            ms = [b.elapsed_time(e) for p, _, b, e in self.events if p == want]
            parts[name] = {
                "steps": len(ms),
                "gpu_s": sum(ms) / 1e3,
                "median_ms": statistics.median(ms) if ms else None,
                "tokens": sum(t for p, t, _, _ in self.events if p == want),
            }
        return parts

    def remove(self) -> None:
        self.runner.step = self.inner


def bound_parts(shape: str, copy_gbps: float, tflops: float) -> dict[str, float]:
    """The workload bound's prefill and decode seconds (gpu.workload_bound_tok_s, taken apart:
    a workload without output tokens is its prefill term)."""
    n, prompt, out = WORKLOAD
    total = n * out / workload_bound_tok_s(shape, WORKLOAD, n, copy_gbps, tflops)
    # the prefill term alone: one output token's decode share is out-th of the decode term
    one = n / workload_bound_tok_s(shape, (n, prompt, 1), n, copy_gbps, tflops)
    decode_one = (total - one) / (out - 1)
    return {"total_s": total, "prefill_s": one - decode_one, "decode_s": total - one + decode_one}


def profile_prefill(engine: Any, vocab: int) -> dict[str, Any]:
    """Kernels of the workload's prefill (fresh prompts, one output token), by kind."""
    n, prompt, _ = WORKLOAD
    run_generate(engine, prompts(n, prompt, vocab, 41), 1)  # warm
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        seconds = run_generate(engine, prompts(n, prompt, vocab, 42), 1)
    by_kind, by_name = kernel_ms_by_kind(prof)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:16]
    return {
        "wall_s": seconds,
        "kernel_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "kernel_total_ms": sum(by_kind.values()),
        "top_kernels_ms": [(name[:110], ms) for name, ms in top],
    }


def main() -> int:
    args = parse_args()
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    res["gpu"] = torch.cuda.get_device_name()
    res["ceilings"] = ceil = ceilings()
    print(f"ceilings: {ceil}", flush=True)
    model_dir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-tput-")) / args.shape
    if not (model_dir / "config.json").exists():
        write_random_llama(model_dir, args.shape, "cuda")
    vocab = SHAPES[args.shape]["vocab_size"]
    n, prompt, out = WORKLOAD
    stats = StepStats()
    engine = tuned_engine(model_dir, args, [WORKLOAD], bench_host(stats))
    try:
        res["tput_tok_s"] = n * out / warm_and_time(engine, WORKLOAD, vocab, 5)
        bound = bound_parts(args.shape, ceil["copy_GBps"], ceil["matmul_TFLOPs"])
        res["bound"] = bound
        res["tput_over_bound"] = res["tput_tok_s"] * bound["total_s"] / (n * out)
        print(f"tput {res['tput_tok_s']:.0f} tok/s, {res['tput_over_bound']:.3f} of bound "
              f"{bound}", flush=True)  # fmt: skip
        engine.core.overlap = False
        timer = StepTimer(engine.core.runner)
        wall = run_generate(engine, prompts(n, prompt, vocab, 9), out)
        res["no_overlap_s"] = wall
        res["split"] = split = timer.split()
        timer.remove()
        engine.core.overlap = True
        print(f"overlap off: {wall:.3f} s, {split}", flush=True)
        res["prefill_profile"] = profile_prefill(engine, vocab)
        print(f"prefill profile: {res['prefill_profile']}", flush=True)
        args.context, args.steps = prompt + out // 2, 32
        res["decode_profile"] = profile_one(
            engine, stats, args, n, vocab, ceil["copy_GBps"]
        )  # fmt: skip
        print(f"decode profile: {res['decode_profile']}", flush=True)
    finally:
        engine.shutdown()
    rows = []
    for part in ("prefill", "decode"):
        got, want = split[part]["gpu_s"], bound[f"{part}_s"]
        rows.append([part, split[part]["steps"], got, want, want / got, got - want])
    print(format_table(["part", "steps", "GPU s (overlap off)", "bound s", "bound / GPU",
                        "gap s"], rows))  # fmt: skip
    if args.json_out:
        write_json(args.json_out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
