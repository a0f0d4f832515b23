"""--speculative-adaptive through the engine (tiny random Llama, n-gram drafts, CPU float32):
each request's draft length follows its own acceptance, so within one step some requests draft
deep and others not at all; with uniform drafts (CUDA-graph-shaped verify steps, forced on
here) every drafting request of a step drafts the step's one length, the shorter n-gram drafts
padded; and greedy outputs equal speculation off either way. The row cost is fixed so that
the lengths do not depend on the machine's speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from radixserve.core.spec_adaptive import AdaptiveDrafting
from radixserve.core.spec_strategy import Speculation, speculation_of

K = 4
NEW_TOKENS = 40
PROMPTS = [
    [7, 8, 9, 10, 11] * 6,  # repeats: the lookup finds full drafts
    [30, 31, 32, 30, 31, 33, 30, 31],  # short matches
    [101, 57, 230, 12, 199, 64, 3, 88],  # nothing repeats at first
    [40, 41, 42, 43] * 5,
]


def _generate(model: Path, uniform: bool, **kw: Any) -> tuple[list[list[int]], dict]:
    with Engine(
        str(model), plugins=["attention=torch_native", "hardware=cpu"], dtype="float32",
        debug_leak_check=True, **kw,
    ) as engine:  # fmt: skip
        strategy = speculation_of(engine.core)
        if strategy is not None:
            strategy.uniform = uniform
        params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        out = engine.generate(input_ids=PROMPTS, sampling_params=params)
        return [o["output_ids"] for o in out], engine.core.spec_stats()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    return _generate(tiny_llama_dir, uniform=False)[0]


@pytest.mark.parametrize("uniform", [False, True], ids=["ragged", "uniform"])
def test_adaptive_lengths_keep_greedy_outputs(
    tiny_llama_dir: Path, reference: list[list[int]], uniform: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(AdaptiveDrafting, "row_cost", lambda self, batch: 0.05)
    steps: list[dict[str, int]] = []
    extend = Speculation.extend_plan

    def recorded(self: Speculation, scheduler: Any, decodes: list[Any]) -> Any:
        drafts = extend(self, scheduler, decodes)
        steps.append({rid: len(d.tokens) for rid, d in drafts.items()})
        return drafts

    monkeypatch.setattr(Speculation, "extend_plan", recorded)
    outputs, stats = _generate(
        tiny_llama_dir, uniform, speculative_algorithm="NGRAM", speculative_num_steps=K,
        speculative_adaptive=True, speculative_disable_batch_size=1,  # ignored when adaptive
    )  # fmt: skip
    assert outputs == reference
    assert stats["adaptive"] is True and stats["accepted_tokens"] > 0, stats
    drafting = [s for s in steps if s]
    assert len(drafting) >= 3, steps
    if uniform:  # one length a step, however long each n-gram match was
        assert all(len(set(s.values())) == 1 for s in drafting), drafting
    else:  # requests of one step draft different lengths, and some steps draft for fewer
        assert any(len(set(s.values())) > 1 for s in drafting), drafting
    # the cut-off of 1 did not apply: steps of several requests drafted
    assert any(len(s) > 1 for s in drafting), drafting
    # some step planned no draft at all for a request that could (lengths follow acceptance)
    assert any(0 < len(s) < len(PROMPTS) for s in drafting) or len(drafting) < len(steps)
