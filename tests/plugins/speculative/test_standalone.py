"""The standalone drafter (plugins/speculative/standalone.py) with sampled requests: its draft
tokens are draws from the draft model's distribution, which rejection sampling then verifies.
A seeded request's draws are seeded too, so its output repeats from run to run, as it does with
speculation off; an unseeded draw made every run of the same seeded request differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine

SEEDED = {"temperature": 1.0, "max_new_tokens": 24, "seed": 1234}


@pytest.mark.slow
def test_seeded_sampled_output_repeats(smollm2_dir: Path) -> None:
    with Engine(
        str(smollm2_dir),
        dtype="float32",
        max_total_tokens=4096,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(smollm2_dir),  # the model drafts for itself
        speculative_disable_pause=True,
        debug_leak_check=True,
    ) as engine:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": "A poem about rain."}])
        runs = [engine.generate(input_ids=ids, sampling_params=SEEDED) for _ in range(3)]
        stats = engine.core.spec_stats()
        engine.core.scheduler.check_no_leak()
    assert stats is not None and stats["verify_steps"] > 0  # it really drafted
    outputs = [r["output_ids"] for r in runs]
    assert len(outputs[0]) == SEEDED["max_new_tokens"]
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
