"""Drafts padded to one length (``Speculation.uniform``, set where the step executor
replays verify graphs of one length, i.e. CUDA): every request of a speculating step verifies
the step's full draft length, whether its n-gram lookup found a shorter draft, none at all, or
the request is paused (its filler then counts in no accept statistic), or the request has fewer
tokens left to make than that (what it emits past its budget is cut); and greedy outputs still
equal speculation off, every one exactly ``max_new_tokens`` long. Checked on the CPU with the
setting forced on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from radixserve.core.spec_strategy import Speculation, speculation_of
from radixserve.core.speculative import Speculator, speculating

K = 4
NEW_TOKENS = 40
PROMPTS = [
    [7, 8, 9, 10, 11] * 6,  # repeats: the lookup finds full drafts
    [30, 31, 32, 30, 31, 33, 30, 31],  # short matches: short drafts
    [101, 57, 230, 12, 199, 64, 3, 88],  # nothing repeats at first: no draft
    [40, 41, 42, 43] * 5,  # paused every other step (below)
]


def _generate(
    model: Path, uniform: bool, new_tokens: int = NEW_TOKENS, **kw: Any
) -> tuple[list[list[int]], dict]:
    with Engine(
        str(model), plugins=["attention=torch_native", "hardware=cpu"], dtype="float32",
        debug_leak_check=True, **kw,
    ) as engine:  # fmt: skip
        strategy = speculation_of(engine.core)
        if strategy is not None:  # (the reference runs without speculation)
            strategy.uniform = uniform
        params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        out = engine.generate(input_ids=PROMPTS, sampling_params=params)
        for o in out:  # a verify emits its accepted drafts + 1, also where the budget cut it
            meta = o["meta_info"]
            emitted = meta.get("spec_accepted_tokens", 0) + meta.get("spec_verify_ct", 0)
            assert emitted <= len(o["output_ids"]) - 1, meta  # the first came from the prefill
        return [o["output_ids"] for o in out], engine.core.spec_stats()


def test_every_request_of_a_speculating_step_verifies_the_full_length(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, _ = _generate(tiny_llama_dir, uniform=False)

    wants, calls = Speculator.wants, {"n": 0}

    def paused_every_other_step(self: Speculator, req: Any) -> bool:
        if req.input_ids == PROMPTS[3]:
            calls["n"] += 1
            return calls["n"] % 2 == 0
        return wants(self, req)

    draft = Speculation.extend_plan
    checked = {"steps": 0, "own_drafts": 0}
    near_the_end = False

    def checked_draft(self: Speculation, scheduler: Any, decodes: list[Any]) -> Any:
        nonlocal near_the_end
        drafts = draft(self, scheduler, decodes)
        if drafts:
            checked["steps"] += 1
            checked["own_drafts"] += len(drafts) - len(self.filler_only)
            for req in decodes:
                if speculating(req):
                    assert len(drafts[req.rid].tokens) == K, (req.input_ids, drafts)
                    near_the_end |= req.sampling.max_new_tokens - req.num_output_tokens <= K
        return drafts

    monkeypatch.setattr(Speculator, "wants", paused_every_other_step)
    monkeypatch.setattr(Speculation, "extend_plan", checked_draft)
    outputs, stats = _generate(
        tiny_llama_dir, uniform=True, speculative_algorithm="NGRAM",
        speculative_num_steps=K, speculative_disable_pause=True,
        speculative_disable_batch_size=len(PROMPTS),  # every request (the CPU's cut-off: 2)
    )  # fmt: skip
    assert checked["steps"] >= 5
    assert near_the_end, "no request drafted the full length within K tokens of its budget"
    assert outputs == reference
    assert all(len(out) == NEW_TOKENS for out in outputs)
    # a paused request's filler is verified, but neither judged nor counted as its drafts
    assert stats["verified_requests"] == checked["own_drafts"], (stats, checked)


@pytest.mark.parametrize("new_tokens", [3, 6])
def test_drafts_cut_by_the_budget_count_only_what_was_kept(
    tiny_llama_dir: Path, new_tokens: int
) -> None:
    """Every draft accepted (simulated), budgets of 3 and 6 tokens: the last verify of each
    request drafts 4 tokens past what is left; its statistics count the tokens kept."""
    outputs, stats = _generate(
        tiny_llama_dir, uniform=True, new_tokens=new_tokens, speculative_algorithm="NGRAM",
        speculative_num_steps=K, speculative_disable_pause=True,
        speculative_disable_batch_size=len(PROMPTS), speculative_simulate_accept_len=K + 1.0,
    )  # fmt: skip
    assert all(len(out) == new_tokens for out in outputs)
    assert stats["verified_requests"] > 0
    # each request: one token from its prefill, then accepted drafts + 1 a verify
    assert stats["accepted_tokens"] + stats["verified_requests"] == len(PROMPTS) * (new_tokens - 1)
