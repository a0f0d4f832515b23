"""Traffic that reuses KV slots, for differential tests of attention backends.

Every round is greedy, so its tokens do not depend on how requests are batched; a backend that
reads a stale row of the slot table (another request's KV, a freed slot) changes them. The
rounds, on one engine so the cache carries over:

1. identical prompts sent together (one prefill is shared, the copies are admitted from it);
2. the same requests again: full cache hits, each admitted with exactly one uncached token;
3. n=4 choices of one new prompt and of one cached prompt;
4. longer outputs than the pool holds: retraction and re-admission, slots freed and reused;
5. round 4 again, from a cache that pressure has half evicted.
"""

from __future__ import annotations

import random
from typing import Any

from radixserve import Engine

LOW, HIGH = 3, 360  # ordinary token ids of the tiny test models


def tokens(seed: int, n: int, low: int = LOW, high: int = HIGH) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


def _greedy(max_new_tokens: int, n: int = 1) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, "n": n}


def _ids(results: Any) -> list[list[int]]:
    if isinstance(results, dict):
        results = [results]
    return [r["output_ids"] for r in results]


def top2_gaps(results: Any) -> list[list[float]]:
    """Per output, per token: the logprob of the chosen token minus that of the runner-up."""
    if isinstance(results, dict):
        results = [results]
    tops = [r["meta_info"]["output_top_logprobs"] for r in results]
    return [[t[0][0] - t[1][0] for t in top] for top in tops]


def run_reuse_traffic(engine: Engine, scale: int = 1, gaps: bool = False) -> dict[str, Any]:
    """Run the rounds; return every round's output ids and the scheduler's counters.
    ``scale`` multiplies prompt lengths and output lengths (1 for CPU tests). With ``gaps``,
    also each output token's top-2 logprob gap, under "gaps" (see ``first_differences``)."""
    logprobs = {"return_logprob": True, "top_logprobs_num": 2} if gaps else {}
    out: dict[str, Any] = {"gaps": {}}

    def run(name: str, prompts: list[list[int]], params: dict[str, Any]) -> None:
        results = engine.generate(input_ids=prompts, sampling_params=params, **logprobs)
        out[name] = _ids(results)
        if gaps:
            out["gaps"][name] = top2_gaps(results)

    shared = tokens(1, 9 * scale)
    prompts = [shared + tokens(10 + i, (3 + 2 * i) * scale) for i in range(4)]
    copies = [p for p in prompts for _ in range(3)]
    run("identical", copies, _greedy(3 * scale))
    run("repeated", copies, _greedy(3 * scale))
    fresh = tokens(99, 11 * scale)
    run("n4", [fresh, prompts[0]], _greedy(3 * scale, n=4))
    pressure = [shared + tokens(200 + i, (2 + i) * scale) for i in range(8)]
    for name in ("pressure", "pressure_again"):
        run(name, pressure, _greedy(12 * scale))
    stats = engine.core.scheduler.stats
    out["retractions"] = stats.retractions
    engine.core.scheduler.check_no_leak()
    return out


def comparable(result: dict[str, Any]) -> dict[str, Any]:
    """The token outputs of a run, without its counters."""
    return {k: v for k, v in result.items() if k not in ("retractions", "gaps")}


# In bfloat16 a correct backend's greedy output may leave the reference's where the reference's top
# two tokens were within this many nats of each other (sums in another order flip them); a wrong
# KV read changes outputs where they were far apart (dropping one key: first differences at gaps
# of 0.4 to 6). Compare on a model of two layers: a random model of 30 layers in bfloat16 is
# chaotic, rounding differences grow to whole nats (H200: flashinfer against triton on the
# SmolLM2 shape, 0/64 outputs equal over 64 tokens, first differences at gaps up to 1.8; on the
# CPU two attention implementations equal up to rounding differ alike). With two layers, on the
# CPU, the first differences sat at gaps of at most 0.125 (one or two bf16 steps of a logit).
NEAR_TIE = 0.25


def first_differences(
    ours: list[list[int]], ref: list[list[int]], ref_gaps: list[list[float]]
) -> list[tuple[int, float]]:
    """(position, the reference's top-2 gap there) where each differing output first differs:
    in bfloat16 two correct backends flip near-ties now and then (greedy outputs then go their
    own way); a backend that read wrong KV differs where the reference was far from a tie."""
    found = []
    for a, b, g in zip(ours, ref, ref_gaps, strict=True):
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if i is not None:
            found.append((i, g[i]))
    return found
