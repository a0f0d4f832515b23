"""core/logprobs.py alone: which prompt positions a request still needs scored (across chunks
and after part of them was recorded) and the logprobs recorded from hand-made logits rows
(milliseconds; the engine-level logprob tests run a model)."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.core.logprobs import first_scored_position, record_input_logprobs, scored_positions
from radixserve.core.request import Req, SamplingParams


def _req(start: int, prompt_len: int = 6, top: int = 0) -> Req:
    req = Req("r", list(range(10, 10 + prompt_len)), SamplingParams(top_logprobs_num=top))
    req.logprob_start_len = start
    return req


def test_first_scored_position_follows_logprob_start_len() -> None:
    assert first_scored_position(_req(-1)) is None  # output tokens only
    assert first_scored_position(_req(0)) == 0  # token 0 has no logprob: position 0 scores 1
    assert first_scored_position(_req(1)) == 0
    assert first_scored_position(_req(3)) == 2
    assert first_scored_position(_req(5)) == 4  # the last prompt token, scored at 4
    assert first_scored_position(_req(6)) is None  # past the prompt
    recorded = _req(2)
    recorded.input_token_logprobs = [-1.0, -2.0]
    assert first_scored_position(recorded) == 3  # what is recorded is never asked again
    recorded.input_token_logprobs += [-1.0, -1.0]
    assert first_scored_position(recorded) is None  # all of 2..5 recorded


def test_scored_positions_clip_to_the_chunk_and_the_prompt() -> None:
    req = _req(2, prompt_len=10)
    assert scored_positions(req, 0, 4) == range(1, 4)
    assert scored_positions(req, 4, 4) == range(4, 8)
    assert scored_positions(req, 8, 4) == range(8, 9)  # position 9 predicts no prompt token
    assert scored_positions(_req(-1), 0, 4) == range(0)
    late = _req(7, prompt_len=10)
    assert list(scored_positions(late, 0, 4)) == []
    assert scored_positions(late, 4, 6) == range(6, 9)


def test_record_input_logprobs_scores_the_next_prompt_token() -> None:
    req = _req(0, prompt_len=4, top=2)
    req.input_ids = [3, 1, 4, 0]
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.5, 0.0], [1.0, 0.0, 3.0, 0.0, 2.5]])
    record_input_logprobs(req, range(0, 2), logits)
    want = torch.log_softmax(logits, dim=-1)
    assert req.input_token_logprobs == pytest.approx([want[0, 1].item(), want[1, 4].item()])
    assert req.input_top_logprobs == [
        [(pytest.approx(want[0, 1].item()), 1), (pytest.approx(want[0, 2].item()), 2)],
        [(pytest.approx(want[1, 2].item()), 2), (pytest.approx(want[1, 4].item()), 4)],
    ]
    record_input_logprobs(req, range(2, 3), torch.zeros(1, 5))  # appended, uniform
    assert req.input_token_logprobs[2] == pytest.approx(-math.log(5))
    assert len(req.input_top_logprobs) == 3


def test_without_top_logprobs_only_the_tokens_are_recorded() -> None:
    req = _req(0, prompt_len=3)
    req.input_ids = [0, 1, 2]
    record_input_logprobs(req, range(1, 2), torch.tensor([[0.0, 0.0, 5.0, 0.0]]))
    assert req.input_token_logprobs == pytest.approx([-math.log(1 + 3 * math.exp(-5.0))])
    assert req.input_top_logprobs == []
