"""Speculation on traffic that reuses KV slots, on the CPU: identical and repeated prompts and a
paged pool too small for the load (retraction and re-admission free and reuse slots while draft
positions are allocated and rolled back). Greedy outputs must equal speculation off, the draft
model must still accept everything when it is the target, and no KV may leak."""

from __future__ import annotations

from pathlib import Path

import pytest
from small_pool_speculation import run_small_pool


@pytest.mark.parametrize("algorithm", ["STANDALONE", "NGRAM"])
def test_speculation_under_retraction_equals_speculation_off(
    tiny_llama_dir: Path, algorithm: str
) -> None:
    reference, _, _ = run_small_pool(tiny_llama_dir)
    extra = (
        {"speculative_draft_model_path": str(tiny_llama_dir)} if algorithm == "STANDALONE" else {}
    )
    outputs, retractions, stats = run_small_pool(
        tiny_llama_dir, speculative_algorithm=algorithm, speculative_disable_pause=True, **extra
    )
    assert retractions > 0, "the pool must force retractions"
    assert outputs == reference
    assert stats["verified_requests"] > 0
    if algorithm == "STANDALONE":
        assert stats["accepted_tokens"] == stats["draft_tokens"]
