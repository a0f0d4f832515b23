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


def run_reuse_traffic(engine: Engine, scale: int = 1) -> dict[str, Any]:
    """Run the rounds; return every round's output ids and the scheduler's counters.
    ``scale`` multiplies prompt lengths and output lengths (1 for CPU tests)."""
    shared = tokens(1, 9 * scale)
    prompts = [shared + tokens(10 + i, (3 + 2 * i) * scale) for i in range(4)]
    copies = [p for p in prompts for _ in range(3)]
    out: dict[str, Any] = {}
    out["identical"] = _ids(engine.generate(input_ids=copies, sampling_params=_greedy(3 * scale)))
    out["repeated"] = _ids(engine.generate(input_ids=copies, sampling_params=_greedy(3 * scale)))
    fresh = tokens(99, 11 * scale)
    out["n4"] = _ids(
        engine.generate(input_ids=[fresh, prompts[0]], sampling_params=_greedy(3 * scale, n=4))
    )
    pressure = [shared + tokens(200 + i, (2 + i) * scale) for i in range(8)]
    for name in ("pressure", "pressure_again"):
        out[name] = _ids(engine.generate(input_ids=pressure, sampling_params=_greedy(12 * scale)))
    stats = engine.core.scheduler.stats
    out["retractions"] = stats.retractions
    engine.core.scheduler.check_no_leak()
    return out


def comparable(result: dict[str, Any]) -> dict[str, Any]:
    """The token outputs of a run, without its counters."""
    return {k: v for k, v in result.items() if k != "retractions"}
