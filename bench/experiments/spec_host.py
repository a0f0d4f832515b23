"""Where a speculating engine's time goes at small batches, on the real default model: per
engine step, its kind (decode, verify, prefill), whether it was launched while the previous
step was still on the device (overlap), and the host time spent launching it, drafting for it
and waiting for results, with speculation off and with each algorithm, over one workload
group of bench/spec_workloads.py. A diagnostic for issue 15 (speculation on the H200 ran below
speculation off even while most requests were paused), not a benchmark.

    python bench/spec_host.py --algorithm EAGLE3 NGRAM --group code_edit --batch 1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

from spec_workloads import HELDOUT_GROUPS, all_workloads, workload_group  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.core.spec_strategy import speculator_of


def kind_of(batch: Any) -> str:
    if batch.extra:
        return "verify" if batch.num_decode + len(batch.extra) == len(batch.reqs) else "mixed"
    if batch.num_decode == len(batch.reqs):
        return "decode"
    return "prefill"


def measure(flags: dict[str, Any], group: str, batch: int, device: str) -> dict[str, Any]:
    workloads = workload_group(group)
    # one process runs every engine: a fixed pool, not a share of what the last one left
    with Engine(plugins=[f"hardware={device}"], max_total_tokens=65536, **flags) as engine:
        core = engine.core
        prompts = [engine.tokenizer.encode_chat(w.messages) for w in workloads]
        limits = [w.max_new_tokens for w in workloads]
        warm = {"max_new_tokens": 16}
        engine.generate(input_ids=prompts[:batch], sampling_params=warm)
        steps: list[dict[str, Any]] = []
        host: dict[str, float] = defaultdict(float)
        launch, propose = core.runner.launch, None
        if speculator_of(core) is not None:
            propose = speculator_of(core).propose

            def timed_propose(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return propose(*a, **k)  # type: ignore[misc]
                finally:
                    host["propose"] += time.perf_counter() - t

            speculator_of(core).propose = timed_propose  # type: ignore[method-assign]

        def timed_launch(b: Any, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            launched = launch(b, *a, **k)
            host["launch"] += time.perf_counter() - t
            steps.append({"kind": kind_of(b), "overlapped": core._in_flight is not None})
            result = launched.result

            def timed_result() -> Any:
                t = time.perf_counter()
                try:
                    return result()
                finally:
                    host["result wait"] += time.perf_counter() - t

            launched.result = timed_result
            return launched

        core.runner.launch = timed_launch  # type: ignore[method-assign]
        start = time.perf_counter()
        tokens = 0
        for at in range(0, len(prompts), batch):
            picks = list(range(at, min(at + batch, len(prompts))))
            params = [{"temperature": 0, "max_new_tokens": limits[j]} for j in picks]
            outs = engine.generate(input_ids=[prompts[j] for j in picks], sampling_params=params)
            tokens += sum(len(o["output_ids"]) for o in outs)
        seconds = time.perf_counter() - start
        by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for s in steps:
            by_kind[s["kind"]][0] += 1
            by_kind[s["kind"]][1] += s["overlapped"]
        kept = speculator_of(core).stats.to_json() if speculator_of(core) is not None else {}
        sp = speculator_of(core)
        classes = {b for _, b in getattr(sp, "_step_samples", {})}
        policy = {
            f"{'verify' if v else 'decode'}@{b}": round(t * 1e3, 3)
            for b in sorted(classes)
            for v in (True, False)
            if (t := sp.step_time(v, b)) is not None
        }
        return {
            "tokens": tokens,
            "seconds": seconds,
            "tok_s": tokens / seconds,
            "steps": {k: {"count": v[0], "overlapped": v[1]} for k, v in by_kind.items()},
            "host_s": dict(host),
            "spec": kept,
            "policy_step_ms": policy,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", nargs="+", default=["EAGLE3"])
    groups = [*sorted(all_workloads()), *HELDOUT_GROUPS]
    p.add_argument("--group", default="code_edit", choices=groups)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    modes = {"off": {}} | {a: {"speculative_algorithm": a} for a in args.algorithm}
    base = None
    for name, flags in modes.items():
        r = measure(flags, args.group, args.batch, args.device)
        base = base or r["tok_s"]
        print(f"== {name}: {r['tokens']} tokens in {r['seconds']:.2f} s = {r['tok_s']:.1f} tok/s "
              f"({r['tok_s'] / base:.2f}x off)")  # fmt: skip
        for kind, c in sorted(r["steps"].items()):
            print(f"   {kind:8s} {c['count']:6d} steps, {c['overlapped']:6d} launched overlapped")
        print("   host s:", {k: round(v, 3) for k, v in r["host_s"].items()})
        if r["spec"]:
            print("   spec:", r["spec"], "policy step ms:", r["policy_step_ms"])


if __name__ == "__main__":
    main()
