"""Speculation under a small paged pool (retraction) with repeated and identical prompts: the
traffic and the run shared by the speculative plugins' tests (greedy outputs must equal
speculation off, with no KV leaked)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from radixserve import Engine

POOL = 160  # tokens, pages of 4: far less than the requests below need at once


def traffic() -> tuple[list[list[int]], dict[str, Any]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 30))] for _ in range(10)]
    prompts += prompts[:4] + [prompts[0]] * 4  # repeated, and identical sent together
    return prompts, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def small_pool_engine(model: Path, **kw: Any) -> Engine:
    """An engine whose paged pool is far too small for the traffic (it retracts), checking
    the KV leak invariant whenever it idles."""
    if "speculative_algorithm" in kw:  # every request drafts (the CPU's cut-off is 2)
        kw.setdefault("speculative_disable_batch_size", 64)
    kw.setdefault("page_size", 4)
    return Engine(
        str(model), dtype="float32", max_total_tokens=POOL, debug_leak_check=True,
        schedule_conservativeness=0.0, **kw,
    )  # fmt: skip


def run_small_pool(model: Path, **kw: Any) -> tuple[list[list[int]], int, Any]:
    """(output ids, retractions, speculation stats) of the traffic on a small-pool engine."""
    prompts, params = traffic()
    with small_pool_engine(model, **kw) as engine:
        out = engine.generate(input_ids=prompts, sampling_params=params)
        engine.core.scheduler.check_no_leak()
        stats = engine.core.scheduler.stats
        return [o["output_ids"] for o in out], stats.retractions, engine.core.spec_stats()
