#!/usr/bin/env python
"""Where one decode step's time goes on CPU, in counts that do not depend on load.

Runs the offline Engine in this process on the default model (or ``--model``), ``--batch``
requests (default 1) of ``--input-len`` random prompt tokens generating ``--output-len`` tokens
greedily, and profiles ``--steps`` decode steps after ``--skip`` warm-up steps, from the
engine's own ``step_finished`` hook (so only whole decode steps are inside):

- torch.profiler: per op kind, calls and self CPU time per step (time is load-dependent; call
  counts are not);
- cProfile: Python function calls per step and the functions with most self time;
- tracemalloc is not used (tensor memory is not Python's); the profiler's ``profile_memory``
  counts the step's tensor allocations instead.

    .venv/bin/python bench/cpu_profile.py                     # float32, threads = cores
    .venv/bin/python bench/cpu_profile.py --quantization int4wo --threads 1 --top 25
    .venv/bin/python bench/cpu_profile.py --batch 32 --steps 8 --skip 4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from common import num_cores, random_prompts, special_token_ids
from torch.profiler import ProfilerActivity, profile

from radixserve import Engine, hookimpl
from radixserve.core.plugins import PluginHost


class StepProfiler:
    """Starts both profilers after ``skip`` decode steps and stops them ``steps`` later."""

    def __init__(self, skip: int, steps: int) -> None:
        self.skip, self.steps = skip, steps
        self.seen = 0
        self.step_times: list[float] = []
        self.torch_prof: profile | None = None
        self.py_prof = cProfile.Profile()
        self.done = False

    @hookimpl
    def step_finished(self, stats: dict[str, Any]) -> None:
        if self.done or stats["num_prefill_tokens"]:
            return
        self.seen += 1
        if self.seen == self.skip:
            self.torch_prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.torch_prof.__enter__()
            self.py_prof.enable()
        elif self.seen > self.skip:
            self.step_times.append(float(stats["step_time_s"]))
            if self.seen == self.skip + self.steps:
                self.py_prof.disable()
                assert self.torch_prof is not None
                self.torch_prof.__exit__(None, None, None)
                self.done = True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the engine's default)")
    p.add_argument("--dtype", default=None, help="engine dtype (default: the platform's)")
    p.add_argument("--quantization", default=None, help="engine --quantization")
    p.add_argument(
        "--enable-torch-compile", action="store_true", help="engine --enable-torch-compile"
    )
    p.add_argument("--threads", type=int, default=num_cores(), help="torch threads")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--skip", type=int, default=8, help="decode steps before profiling")
    p.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    p.add_argument("--top", type=int, default=15, help="rows of each table")
    p.add_argument("--json-out", help="write the per-step counts here")
    args = p.parse_args(argv)
    if args.output_len < args.skip + args.steps + 2:
        args.output_len = args.skip + args.steps + 2
    return args


def torch_table(prof: profile, steps: int, top: int) -> tuple[str, dict[str, Any]]:
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total_us = sum(e.self_cpu_time_total for e in rows) / steps
    calls = sum(e.count for e in rows) / steps
    allocs = sum(e.cpu_memory_usage > 0 for e in rows)
    lines = [f"torch ops per step: {calls:.0f} calls, {total_us / 1e3:.2f} ms self CPU"]
    lines.append(f"{'op':<40} {'calls/step':>10} {'self ms/step':>12} {'share':>6}")
    for e in rows[:top]:
        share = e.self_cpu_time_total / steps / total_us if total_us else 0.0
        lines.append(
            f"{e.key[:40]:<40} {e.count / steps:>10.1f} "
            f"{e.self_cpu_time_total / steps / 1e3:>12.3f} {share:>6.1%}"
        )
    data = {
        "op_calls_per_step": calls,
        "self_cpu_ms_per_step": total_us / 1e3,
        "ops_allocating": allocs,
        "ops": {
            e.key: {"calls": e.count / steps, "self_ms": e.self_cpu_time_total / steps / 1e3}
            for e in rows
        },
    }
    return "\n".join(lines), data


def python_table(prof: cProfile.Profile, steps: int, top: int) -> tuple[str, dict[str, Any]]:
    st = pstats.Stats(prof)
    calls = st.total_calls / steps  # type: ignore[attr-defined]
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    body = out.getvalue().split("ncalls", 1)
    text = f"python function calls per step: {calls:.0f}\n   ncalls" + (body[1] if body[1:] else "")
    return text, {"python_calls_per_step": calls}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prof = StepProfiler(args.skip, args.steps)
    host = PluginHost(extra_plugins=[("bench-step-profiler", prof)])
    settings: dict[str, Any] = {
        "max_total_tokens": args.batch * (args.input_len + args.output_len) + 64
    }
    for name in ("dtype", "quantization", "enable_torch_compile"):
        if getattr(args, name):
            settings[name] = getattr(args, name)
    t0 = time.perf_counter()
    engine = Engine(model_path=args.model, host=host, **settings)
    start_s = time.perf_counter() - t0
    try:
        vocab = engine.core.runner.model_config.vocab_size
        avoid = special_token_ids(engine.model_dir)
        prompt = random_prompts(args.batch, args.input_len, vocab, avoid, 0)
        params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
        engine.generate(input_ids=prompt, sampling_params=params)
    finally:
        engine.shutdown()
    assert prof.done and prof.torch_prof is not None, "too few decode steps were profiled"
    t_text, t_data = torch_table(prof.torch_prof, args.steps, args.top)
    p_text, p_data = python_table(prof.py_prof, args.steps, args.top)
    step_ms = 1e3 * sorted(prof.step_times)[len(prof.step_times) // 2]
    print(f"engine start-up {start_s:.1f} s; decode step median {step_ms:.2f} ms (profiled)")
    print(t_text)
    print(p_text)
    if args.json_out:
        data = {"args": vars(args), "step_ms_median": step_ms, "start_s": start_s}
        with open(args.json_out, "w") as f:
            json.dump({**data, **t_data, **p_data}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
