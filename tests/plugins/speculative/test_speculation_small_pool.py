"""Speculation on traffic that reuses KV slots, on the CPU: identical and repeated prompts and a
paged pool too small for the load (retraction and re-admission free and reuse slots while draft
positions are allocated and rolled back). Greedy outputs must equal speculation off, the draft
model must still accept everything when it is the target, and no KV may leak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from small_pool_speculation import run_small_pool

from radixserve import Engine
from radixserve.core.spec_strategy import speculator_of


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


def test_standalone_draft_reuses_the_kv_of_a_prefix_the_cache_shares(tiny_llama_dir: Path) -> None:
    """A request whose prompt prefix the radix cache matched does not draft that prefix again:
    the draft model's KV at those slots, written for the earlier request, is still valid. With
    the target as its own draft every draft must still be accepted (stale draft KV would not
    be), and the outputs equal speculation off."""
    shared = [10 + i for i in range(64)]
    prompts = [shared + [100 + i, 200 + i] for i in range(3)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(str(tiny_llama_dir), dtype="float32") as engine:
        off = engine.generate(input_ids=prompts, sampling_params=params)
    reference = [o["output_ids"] for o in off]
    with Engine(
        str(tiny_llama_dir), dtype="float32", speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(tiny_llama_dir), speculative_disable_pause=True,
        speculative_disable_batch_size=64,
    ) as engine:  # fmt: skip
        assert speculator_of(engine.core) is not None
        draft = speculator_of(engine.core).algorithm
        fed: list[int] = []
        step = draft.step
        draft.step = lambda fb: (fed.append(int(fb.input_ids.numel())), step(fb))[1]
        outputs = [engine.generate(input_ids=prompts[0], sampling_params=params)["output_ids"]]
        fed_first, fed[:] = sum(fed), []
        later = engine.generate(input_ids=prompts[1:], sampling_params=params)
        outputs += [o["output_ids"] for o in later]
        stats = engine.core.spec_stats()
        # Flushed, the cache frees every slot: none may pass for holding reusable draft KV any
        # more (a new request given one must compute its own).
        assert (draft._stamps >= 0).sum() >= len(shared)
        assert engine.flush_cache()
        every_slot = torch.arange(len(draft._stamps))
        assert not bool((draft._stamps == draft._free_counts(every_slot)).any())
    assert outputs == reference
    assert stats["accepted_tokens"] == stats["draft_tokens"] > 0
    assert fed_first >= len(prompts[0])  # the first request's whole prompt, once
    # Each later request catches up its own two tokens and the last one, then drafts; without
    # the shared prefix's draft KV each would feed its 66 prompt tokens first.
    assert sum(fed) < len(shared), fed
