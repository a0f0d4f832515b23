"""Speculation on traffic that reuses KV slots, on the CPU: identical and repeated prompts and a
paged pool too small for the load (retraction and re-admission free and reuse slots while draft
positions are allocated and rolled back). Greedy outputs must equal speculation off, the draft
model must still accept everything when it is the target, and no KV may leak."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine

POOL = 160  # tokens, pages of 4: far less than the requests below need at once


def _traffic() -> tuple[list[list[int]], dict[str, Any]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 30))] for _ in range(10)]
    prompts += prompts[:4] + [prompts[0]] * 4  # repeated, and identical sent together
    return prompts, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def _run(model: Path, **kw: Any) -> tuple[list[list[int]], int, Any]:
    prompts, params = _traffic()
    with Engine(
        str(model), dtype="float32", page_size=4, max_total_tokens=POOL, debug_leak_check=True,
        schedule_conservativeness=0.0, **kw,
    ) as engine:  # fmt: skip
        out = engine.generate(input_ids=prompts, sampling_params=params)
        engine.core.scheduler.check_no_leak()
        stats = engine.core.scheduler.stats
        return [o["output_ids"] for o in out], stats.retractions, engine.core.spec_stats()


@pytest.mark.parametrize("algorithm", ["STANDALONE", "NGRAM"])
def test_speculation_under_retraction_equals_speculation_off(
    tiny_llama_dir: Path, algorithm: str
) -> None:
    reference, _, _ = _run(tiny_llama_dir)
    extra = (
        {"speculative_draft_model_path": str(tiny_llama_dir)} if algorithm == "STANDALONE" else {}
    )
    outputs, retractions, stats = _run(
        tiny_llama_dir, speculative_algorithm=algorithm, speculative_disable_pause=True, **extra
    )
    assert retractions > 0, "the pool must force retractions"
    assert outputs == reference
    assert stats["verified_requests"] > 0
    if algorithm == "STANDALONE":
        assert stats["accepted_tokens"] == stats["draft_tokens"]
