"""Where a cycle of the device-side speculative loop (core/spec_loop.py) spends its time, on the
real default model at batch 1: the cycle's wall time in a long greedy generation (drafting every
step), the device time of one cycle graph and of one decode graph replayed back to back, and
the host's profile of the loop. A diagnostic for issue 15, not a benchmark.

    python bench/spec_loop_profile.py --algorithm EAGLE3 --group json_repeat
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

from spec_workloads import workload_group  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.core.spec_strategy import loop_of, speculator_of


def replay_ms(replay: Any, sync: Any, n: int = 200) -> float:
    """Milliseconds a replay takes when queued back to back (device time, launch-bound or not)."""
    for _ in range(10):
        replay()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        replay()
    sync()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", default="EAGLE3")
    p.add_argument("--group", default="json_repeat")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--num-steps", type=int, default=None, help="--speculative-num-steps")
    args = p.parse_args()
    import torch

    prompt_of = workload_group(args.group)
    flags: dict[str, Any] = {
        "speculative_algorithm": args.algorithm,
        "speculative_disable_pause": True,
    }
    if args.num_steps is not None:
        flags["speculative_num_steps"] = args.num_steps
    if args.device == "cpu":  # a smoke test of this script
        flags["enable_speculative_loop"] = True
    with Engine(plugins=[f"hardware={args.device}"], max_total_tokens=65536, **flags) as engine:
        core = engine.core
        ids = [engine.tokenizer.encode_chat(w.messages) for w in prompt_of]
        params = {"temperature": 0, "max_new_tokens": args.tokens, "ignore_eos": True}
        engine.generate(input_ids=ids[0], sampling_params={"max_new_tokens": 16})
        loop = loop_of(core)
        host = {"launch": 0.0, "wait": 0.0, "commit": 0.0}
        if loop is not None:
            launch_cycle, commit = loop.cycle.launch, loop._commit

            def timed_launch() -> Any:
                t = time.perf_counter()
                fetch = launch_cycle()
                host["launch"] += time.perf_counter() - t

                def timed_fetch() -> Any:
                    t = time.perf_counter()
                    try:
                        return fetch()
                    finally:
                        host["wait"] += time.perf_counter() - t

                return timed_fetch

            def timed_commit(emitted: Any) -> Any:
                t = time.perf_counter()
                try:
                    return commit(emitted)
                finally:
                    host["commit"] += time.perf_counter() - t

            loop.cycle.launch = timed_launch  # type: ignore[method-assign]
            loop._commit = timed_commit  # type: ignore[method-assign]
        for i, prompt in enumerate(ids[:4]):
            for key in host:
                host[key] = 0.0
            c0 = loop.cycles if loop else 0
            s0 = core.spec_stats() or {}
            t = time.perf_counter()
            out = engine.generate(input_ids=prompt, sampling_params=params)
            dt = time.perf_counter() - t
            s1 = core.spec_stats() or {}
            cycles = (loop.cycles if loop else 0) - c0
            n = len(out["output_ids"])
            verified = s1.get("verified_requests", 0) - s0.get("verified_requests", 0)
            acc = s1.get("accepted_tokens", 0) - s0.get("accepted_tokens", 0)
            print(
                f"prompt {i}: {n} tokens in {dt * 1e3:.0f} ms, {n / dt:.0f} tok/s, "
                f"{cycles} cycles ({dt / max(cycles, 1) * 1e3:.2f} ms each incl. prefill), "
                f"accept {(verified + acc) / max(verified, 1):.2f}; host per cycle: "
                + ", ".join(f"{k} {v / max(cycles, 1) * 1e3:.3f} ms" for k, v in host.items()),
                flush=True,
            )
        # the engine steps on a thread of its own: profile each step there
        profiler = cProfile.Profile()
        step_once = core.step
        core.step = lambda: profiler.runcall(step_once)  # type: ignore[method-assign]
        t = time.perf_counter()
        out = engine.generate(input_ids=ids[1], sampling_params=params)
        dt = time.perf_counter() - t
        core.step = step_once  # type: ignore[method-assign]
        print(f"profiled run: {len(out['output_ids'])} tokens in {dt * 1e3:.0f} ms")
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile_top)
        print(text.getvalue())
        # Last (the replays write KV at whatever slots their buffers name): device times.
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        step = core.runner.step
        if hasattr(step, "graphs") and 1 in step.graphs:
            print(f"decode graph bs1: {replay_ms(step.graphs[1][0].replay, sync):.3f} ms/replay")
        if loop is not None and getattr(loop.cycle, "graphs", None):
            cycle = loop.cycle
            cycle.rows[:1].fill_(core.runner.req_to_token.pad_row)  # slot 0 only
            cycle.kv_lens[:1].fill_(64)
            graph = cycle.graphs[1]
            print(f"cycle graph bs1: {replay_ms(graph.replay, sync, 100):.3f} ms/replay")
            cycle.kv_lens[:1].fill_(64)
        chain = getattr(speculator_of(core).algorithm, "chain", None)
        if chain is not None and 1 in chain.graphs:
            print(f"proposal graph bs1: {replay_ms(chain.graphs[1].replay, sync):.3f} ms/replay")
        verify = getattr(step, "verify_graphs", {})
        if 1 in verify:
            print(f"verify graph bs1: {replay_ms(verify[1][0].replay, sync):.3f} ms/replay")


if __name__ == "__main__":
    main()
