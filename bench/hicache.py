#!/usr/bin/env python
"""HiCache benchmark: multi-turn chat whose histories outgrow the device KV pool, with the
hierarchical cache on against off (the plain radix cache), in one run, same engine settings,
same prompts.

Traffic: N conversations of T turns; each turn adds U random user tokens to the conversation's
history (its earlier prompts and answers) and generates O tokens (greedy, EOS ignored). At most
C conversations have a turn in flight; a conversation's next turn is queued when its previous
one ends, behind the others (round robin), so between two turns of one conversation the others
push its history out of the device pool. Reported: TTFT p50 / p99 (from a turn's submission to
its first token, stepping the engine core directly) and output throughput, on and off, and the
ratios off / on (TTFT) and on / off (throughput); the cached tokens per tier with HiCache on;
and the share of turns whose greedy outputs are identical between the two runs.

    # the issue's workload (32 x 8 turns, histories up to 4k, device pool 8k), on an H200:
    python bench/hicache.py --device cuda --json-out $OUT/hicache.json
    # the same scaled so the histories are 4x the device pool (8B shape):
    python bench/hicache.py --device cuda --max-total-tokens 32768 --hicache-ratio 5 \
        --json-out $OUT/hicache.json
    # CPU (2 cores), scaled down: a small random-weight shape (bench/gpu_model.py cpu-small)
    python bench/hicache.py --device cpu --small
    # HiCache on with prefetch while queued (and the file storage tier), the issue's size
    # on the CPU, one run per system:
    python bench/hicache.py --device cpu --prefetch --storage --once
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import machine_info, write_json  # noqa: E402
from gpu import StepStats, bench_host  # noqa: E402
from gpu_model import SHAPES, write_random_llama  # noqa: E402

from radixserve.core.config import EngineConfig  # noqa: E402
from radixserve.core.engine_core import EngineCore  # noqa: E402
from radixserve.core.request import Req, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default=None, help="default: llama3-8b on cuda, cpu-small on cpu")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user", type=int, default=480, help="user tokens per turn")
    p.add_argument("--output", type=int, default=32, help="output tokens per turn")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="device KV pool")
    p.add_argument("--hicache-ratio", type=float, default=8.0)
    p.add_argument("--write-policy", default="write_through")
    p.add_argument("--io-backend", default=None,
                   help="--hicache-io-backend; default: the engine's (kernel on cuda, "
                   "direct on cpu)")
    p.add_argument("--mem-layout", default=None, choices=["layer_first", "page_first"],
                   help="--hicache-mem-layout; default: the engine's (page_first on cuda, "
                   "layer_first on cpu)")  # fmt: skip
    p.add_argument("--page-size", type=int, default=None, help="default: 16 cuda, 1 cpu")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefetch", action="store_true", help="on: --enable-hicache-prefetch")
    p.add_argument("--prefetch-policy", default="best_effort")
    p.add_argument("--storage", action="store_true", help="on: the file storage tier (L3)")
    p.add_argument("--once", action="store_true", help="off then on, not off on on off")
    p.add_argument("--small", action="store_true", help="a size a 2-core CPU runs in minutes")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.shape is None:
        args.shape = "llama3-8b" if args.device == "cuda" else "cpu-small"
    if args.page_size is None:
        args.page_size = 16 if args.device == "cuda" else 1
    if args.small:
        args.conversations, args.turns, args.user, args.output = 8, 6, 64, 4
        args.concurrency, args.max_total_tokens = 2, 1024
    return args


def _engine(
    model_dir: Path, args: argparse.Namespace, hicache: bool, stats: StepStats
) -> EngineCore:
    attention = "triton" if args.device == "cuda" else "torch_native"
    context = args.turns * (args.user + args.output) + 16
    config = EngineConfig(
        plugins=(f"hardware={args.device}", f"attention={attention}", "grammar=none"),
        max_running_requests=args.concurrency, max_total_tokens=args.max_total_tokens,
        context_length=context, chunked_prefill_size=args.chunked_prefill_size,
        page_size=args.page_size, dtype=args.dtype, enable_hierarchical_cache=hicache,
        hicache_ratio=args.hicache_ratio, hicache_write_policy=args.write_policy,
        hicache_io_backend=args.io_backend, hicache_mem_layout=args.mem_layout,
        **(_prefetch_flags(args) if hicache else {}),
    )  # fmt: skip
    return EngineCore(model_dir, config, bench_host(stats))


def _prefetch_flags(args: argparse.Namespace) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    if args.prefetch:
        flags["enable_hicache_prefetch"] = True
        flags["hicache_storage_prefetch_policy"] = args.prefetch_policy
    if args.storage:  # a fresh directory per run: no run reads another's pages
        store = tempfile.mkdtemp(prefix="kv-", dir=args.workdir)
        flags["hicache_storage_backend"] = "file"
        flags["hicache_storage_backend_extra_config"] = json.dumps({"dir": store})
    return flags


def run(model_dir: Path, args: argparse.Namespace, vocab: int, hicache: bool) -> dict[str, Any]:
    stats = StepStats()
    core = _engine(model_dir, args, hicache, stats)
    rng = random.Random(0)
    users = [
        [[rng.randrange(3, vocab) for _ in range(args.user)] for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    turn = [0] * args.conversations
    ready = deque(range(args.conversations))
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    steps_at: dict[str, int] = {}  # the engine steps taken when a turn was sent
    ttft_steps: list[int] = []  # steps from a turn's submission to its first token
    taken = 0
    outputs: dict[str, list[int]] = {}
    live: dict[str, tuple[int, Req]] = {}
    params = SamplingParams(max_new_tokens=args.output, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()

    def submit() -> None:
        while ready and len(live) < args.concurrency:
            c = ready.popleft()
            prompt = history[c] + users[c][turn[c]]
            req = Req(f"c{c}t{turn[c]}", prompt, params)
            live[req.rid] = (c, req)
            sent[req.rid] = time.perf_counter()
            steps_at[req.rid] = taken
            core.add_request(req)

    submit()
    while live:
        changed = core.step()
        taken += 1
        now = time.perf_counter()
        for req in changed:
            if req.rid not in first and req.output_ids:
                first[req.rid] = now
                ttft_steps.append(taken - steps_at[req.rid])
            if req.finished and req.rid in live:
                c, _ = live.pop(req.rid)
                outputs[req.rid] = list(req.output_ids)
                history[c] = req.input_ids + list(req.output_ids)
                turn[c] += 1
                if turn[c] < args.turns:
                    ready.append(c)
        submit()
    wall = time.perf_counter() - start
    ttft = [first[r] - sent[r] for r in first]
    tiers = core.cache.tier_stats()
    cached = core.scheduler.stats.cached_tokens
    kinds = core.scheduler.stats.by_kind.values()
    steps, prefilled = sum(k.steps for k in kinds), sum(k.prefill_tokens for k in kinds)
    core.shutdown()
    return {
        "ttft_s": ttft,
        "ttft_steps": ttft_steps,
        "output_tokens": sum(len(o) for o in outputs.values()),
        "wall_s": wall,
        "cached_tokens": cached,
        "steps": steps,
        "prefill_tokens": prefilled,
        "tiers": tiers,
        "outputs": outputs,
        **_step_times(stats.steps),
    }


def _step_times(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median host time of the steps that prefilled and of those that only decoded (with
    overlap a step's host time is about the device time of the step before it)."""
    prefill = [s["step_time_s"] for s in steps if s["num_prefill_tokens"] > 0]
    decode = [s["step_time_s"] for s in steps if s["num_prefill_tokens"] == 0]
    return {
        "prefill_steps": len(prefill),
        "prefill_step_ms_p50": statistics.median(prefill) * 1e3 if prefill else 0.0,
        "decode_step_ms_p50": statistics.median(decode) * 1e3 if decode else 0.0,
    }


def _pool(a: dict[str, Any], b: dict[str, Any] | None) -> dict[str, Any]:
    """Two runs of one system as one (or one run, ``--once``): TTFT percentiles over the
    runs' turns, throughput over their wall time."""
    runs = [a] if b is None else [a, b]
    ttft = sorted(t for r in runs for t in r["ttft_s"])
    ttft_steps = sorted(t for r in runs for t in r["ttft_steps"])
    assert all(r["outputs"] == a["outputs"] for r in runs), "a system's runs differ"
    return {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "ttft_steps_p50": statistics.median(ttft_steps),
        "output_tok_s": sum(r["output_tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
        "wall_s": [r["wall_s"] for r in runs],
        **{k: a[k] for k in ("cached_tokens", "steps", "prefill_tokens", "tiers", "outputs")},
        **{k: a[k] for k in ("prefill_steps", "prefill_step_ms_p50", "decode_step_ms_p50")},
    }


def main() -> None:
    args = parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hicache-bench-"))
    args.workdir = str(workdir)
    model_dir = workdir / args.shape
    if not (model_dir / "config.json").exists():
        write_random_llama(model_dir, args.shape, "cpu")
    vocab = SHAPES[args.shape]["vocab_size"]
    longest = args.turns * (args.user + args.output)
    print(
        f"{args.conversations} conversations x {args.turns} turns, history up to {longest} "
        f"tokens ({args.conversations * longest} in all), device pool {args.max_total_tokens}"
    )
    # ABBA: the second engine of a process ran slower than the first on the CPU (either way),
    # so each system runs once first and once second; their runs are pooled.
    order = (False, True) if args.once else (False, True, True, False)
    rounds = [run(model_dir, args, vocab, on) for on in order]
    if args.once:
        results = {"off": _pool(rounds[0], None), "on": _pool(rounds[1], None)}
    else:
        results = {"off": _pool(rounds[0], rounds[3]), "on": _pool(rounds[1], rounds[2])}
    off, on = results["off"], results["on"]
    same = sum(on["outputs"][r] == o for r, o in off["outputs"].items()) / len(off["outputs"])
    summary = {
        "ttft_p50_ratio_off_over_on": off["ttft_p50_s"] / on["ttft_p50_s"],
        "ttft_p99_ratio_off_over_on": off["ttft_p99_s"] / on["ttft_p99_s"],
        "throughput_ratio_on_over_off": on["output_tok_s"] / off["output_tok_s"],
        "identical_outputs": same,
    }
    for name, r in results.items():
        print(
            f"hicache {name:3s}: TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms  p99 "
            f"{r['ttft_p99_s'] * 1e3:8.1f} ms ({r['ttft_steps_p50']:.0f} steps at p50)  "
            f"{r['output_tok_s']:8.1f} out tok/s  "
            f"{r['steps']} steps  {r['prefill_tokens']} prefilled  cached {r['cached_tokens']}"
        )
    for name, r in results.items():
        print(
            f"steps {name:3s}: {r['prefill_steps']} prefilled, median "
            f"{r['prefill_step_ms_p50']:.1f} ms; decode only median "
            f"{r['decode_step_ms_p50']:.1f} ms"
        )
    print(f"tiers (on): {on['tiers']}  walls off {off['wall_s']} on {on['wall_s']}")
    print(" ".join(f"{k}={v:.2f}" for k, v in summary.items()))
    if args.json_out:
        for r in results.values():
            r.pop("outputs")
        write_json(args.json_out, {"machine": machine_info(), "args": vars(args),
                                   "results": results, "summary": summary})  # fmt: skip


if __name__ == "__main__":
    main()
