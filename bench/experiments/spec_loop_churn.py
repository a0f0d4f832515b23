"""How often the device-side speculative loop stops and restarts, and what that costs, on one
workload group at one batch size (a diagnostic for issue 15: code edits at batch 4 ran at a
fifth of speculation off on the H200 with the loop on, JSON at 1.7x).

    python bench/spec_loop_churn.py --group code_edit --batch 4
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

from spec_workloads import workload_group  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.core.spec_strategy import loop_of, speculator_of


def timed(
    owner: Any, name: str, spent: dict[str, float], counts: Counter[str],
    calls: dict[str, list[float]],
) -> None:  # fmt: skip
    """Wrap ``owner.name`` so that its calls are counted and timed under ``name``."""
    call = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return call(*a, **k)
        finally:
            took = time.perf_counter() - t
            spent[name] += took
            counts[name] += 1
            calls.setdefault(name, []).append(took)

    setattr(owner, name, wrapper)


def profiled(owner: Any, name: str, profile: cProfile.Profile) -> None:
    """Run every call of ``owner.name`` under ``profile``, and print the slow ones' shapes."""
    call = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        profile.enable()
        try:
            return call(*a, **k)
        finally:
            profile.disable()
            took = time.perf_counter() - t
            if took > 0.05 and a and isinstance(a[0], list):  # catch_up_to_span(reqs, span)
                lens = [(r.kv_len, len(r.output_ids)) for r in a[0]]
                print(f"slow {name}: {took * 1e3:.0f} ms, (kv_len, outputs) {lens}")

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group", default="code_edit")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--disable-pause", action="store_true")
    p.add_argument("--rounds", type=int, default=2, help="the group this many times, one engine")
    p.add_argument(
        "--profile-catch-up", type=int, default=0, metavar="N",
        help="profile the catch-ups (cProfile) and print the top N functions by cumulative time",
    )  # fmt: skip
    p.add_argument("--profile-launch", action="store_true", help="profile host steps instead")
    args = p.parse_args()
    flags: dict[str, Any] = {"speculative_algorithm": "EAGLE3"}
    if args.disable_pause:
        flags["speculative_disable_pause"] = True
    if args.device == "cpu":
        flags |= {"enable_speculative_loop": True, "speculative_disable_batch_size": 4}
    workloads = workload_group(args.group)
    with Engine(plugins=[f"hardware={args.device}"], **flags) as engine:
        core = engine.core
        loop = loop_of(core)
        assert loop is not None
        spent: dict[str, float] = Counter()  # type: ignore[assignment]
        counts: Counter[str] = Counter()
        calls: dict[str, list[float]] = {}
        drafter = speculator_of(core).algorithm
        profile = cProfile.Profile()
        if args.profile_catch_up and args.profile_launch:
            profiled(core.runner, "launch", profile)
        elif args.profile_catch_up:
            profiled(drafter, "catch_up_to_span", profile)
        for owner, name in [
            (loop.cycle, "begin"), (loop, "stop"), (loop, "advance"), (core.runner, "launch"),
            (drafter, "catch_up_to_span"),
        ]:  # fmt: skip
            timed(owner, name, spent, counts, calls)
        stop_why: Counter[str] = Counter()
        can_continue = loop.can_continue

        def why() -> bool:
            ok = can_continue()
            if not ok:
                s = core.scheduler
                reason = (
                    "waiting" if s.waiting else
                    "finished" if len(s.running) != len(loop.reqs) else
                    "paused" if not loop._pays(loop.reqs) else "other"
                )  # fmt: skip
                stop_why[reason] += 1
            return ok

        loop.can_continue = why  # type: ignore[method-assign]
        prompts = [engine.tokenizer.encode_chat(w.messages) for w in workloads]
        params = [{"temperature": 0, "max_new_tokens": w.max_new_tokens} for w in workloads]
        engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 8})
        for r in range(args.rounds):
            for key in list(spent):
                spent[key] = 0.0
            counts.clear()
            calls.clear()
            stop_why.clear()
            c0, l0, v0 = loop.cycles, loop.loops, loop.verdicts
            t = time.perf_counter()
            tokens = 0
            for i in range(0, len(prompts), args.batch):
                out = engine.generate(
                    input_ids=prompts[i : i + args.batch],
                    sampling_params=params[i : i + args.batch],
                )
                tokens += sum(len(o["output_ids"]) for o in out)
            dt = time.perf_counter() - t
            rate = tokens / dt
            print(f"round {r}, {args.group} batch {args.batch}: {tokens} tokens in {dt:.2f} s "
                  f"({rate:.0f} tok/s)")  # fmt: skip
            print(f"loops {loop.loops - l0}, cycles {loop.cycles - c0}, "
                  f"host steps {counts['launch']}, verdicts {loop.verdicts - v0}")  # fmt: skip
            print("stops:", dict(stop_why))
            for key in spent:
                slowest = ", ".join(f"{x * 1e3:.1f}" for x in sorted(calls.get(key, []))[-3:])
                print(f"  {key}: {counts[key]} calls, {spent[key] * 1e3:.1f} ms "
                      f"(slowest ms: {slowest})")  # fmt: skip
            print(core.spec_stats())
        if args.profile_catch_up:
            for key in ("cumulative", "tottime"):
                pstats.Stats(profile).sort_stats(key).print_stats(args.profile_catch_up)


if __name__ == "__main__":
    main()
