"""The step times the speculation policy is given (EngineCore): a verify step in which some
request drafted without having drafted in the step before (its first draft, or its first after
a pause) is marked ``catching_up``, so its drafter's catch-up is not taken for what drafting
costs; verify steps that follow one another are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from radixserve.core.interfaces import Draft
from radixserve.core.speculative import Speculator

#: Whether the request drafts, step by step: pauses after the 3rd and 5th verify steps.
SCHEDULE = [True, True, True, False, False, True, True, False, True, True, True]


def test_verify_steps_after_a_pause_or_first_are_marked_catching_up(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"wants": 0}
    observed: list[tuple[bool, bool]] = []

    def scheduled(self: Speculator, req: Any) -> bool:
        at = calls["wants"]
        calls["wants"] += 1
        return SCHEDULE[at] if at < len(SCHEDULE) else False

    def fixed(self: Speculator, reqs: Any, limits: Any) -> list[Draft]:
        return [Draft([5, 6][:limit]) for limit in limits]

    observe = Speculator.observe_step

    def recorded(
        self: Speculator, verify: bool, *args: Any, catching_up: bool = False, **kw: Any
    ) -> None:
        observed.append((verify, catching_up))
        observe(self, verify, *args, catching_up=catching_up, **kw)

    monkeypatch.setattr(Speculator, "wants", scheduled)
    monkeypatch.setattr(Speculator, "propose", fixed)
    monkeypatch.setattr(Speculator, "observe_step", recorded)
    with Engine(
        str(tiny_llama_dir), plugins=["attention=torch_native", "hardware=cpu"],
        dtype="float32", speculative_algorithm="NGRAM",
    ) as engine:  # fmt: skip
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        engine.generate(input_ids=[[7, 8, 9, 10, 11] * 4], sampling_params=params)
    steps = observed[: len(SCHEDULE)]
    assert [verify for verify, _ in steps] == SCHEDULE
    catching_up = [c for verify, c in steps if verify]
    assert catching_up == [True, False, False, True, False, True, False, False]
