"""core/pooling.py engine-free: which final hidden states a step's embedding requests need
(mean: every new token; last: the prompt's last token, in its last chunk), the pooled and
L2-normalised embeddings across chunks, and the logprobs of label tokens."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.core.pooling import PoolPlan, finish_pooling, plan_pooling, record_label_logprobs
from radixserve.core.request import Req, SamplingParams


def req(n: int, pooling: str | None, kv_len: int = 0) -> Req:
    r = Req("r", list(range(n)), SamplingParams(max_new_tokens=0))
    r.pooling, r.kv_len = pooling, kv_len
    return r


def test_a_step_without_embedding_requests_plans_nothing() -> None:
    assert plan_pooling([req(3, None), req(2, None)], [3, 2]) is None
    assert plan_pooling([], []) is None
    last = req(5, "last")  # a first chunk of 3 of 5 tokens: no row yet
    assert plan_pooling([req(2, None), last], [2, 3]) is None
    with pytest.raises(ValueError):
        plan_pooling([req(2, None)], [2, 1])


def test_the_rows_each_request_needs() -> None:
    text, mean, last = req(9, None), req(4, "mean"), req(3, "last")
    mean2, last2 = req(6, "mean", 2), req(5, "last", 2)
    # the flattened step: text 1 (row 0), mean 4 (1..4), last 3 (5..7), mean2 2 of 6 from 2
    # (8, 9: not final), last2 3 of 5 from 2 (10..12: final, row 12)
    plan = plan_pooling([text, mean, last, mean2, last2], [1, 4, 3, 2, 3])
    assert plan == PoolPlan(
        rows=[1, 2, 3, 4, 7, 8, 9, 12],
        entries=[(mean, 0, 4, True), (last, 4, 1, True), (mean2, 5, 2, False), (last2, 7, 1, True)],
    )


def test_mean_pooling_accumulates_across_chunks() -> None:
    r = req(4, "mean")
    hidden = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 8.0]], dtype=torch.float16)
    finish_pooling(PoolPlan([0, 1, 2], [(r, 0, 2, False)]), hidden)  # tokens 0, 1
    assert r.pooled_sum.tolist() == [4.0, 0.0] and r.pooled_sum.dtype == torch.float32
    assert r.embedding is None
    r.kv_len = 2
    hidden = torch.tensor([[9.0, 9.0], [0.0, 2.0], [4.0, 2.0]])
    finish_pooling(PoolPlan([1, 2], [(r, 1, 2, True)]), hidden)  # tokens 2, 3: sum (8, 4)
    assert r.embedding == pytest.approx([2 / math.sqrt(5), 1 / math.sqrt(5)])
    assert r.pooled_sum is None
    # a retracted request starts over at 0: its old sum is dropped
    r.pooled_sum, r.kv_len, r.embedding = torch.tensor([100.0, 100.0]), 0, None
    finish_pooling(PoolPlan([0], [(r, 0, 4, True)]), torch.tensor([[0.0, 1.0]] * 4))
    assert r.embedding == pytest.approx([0.0, 1.0])


def test_the_floor_of_the_norm_applies_to_the_mean() -> None:
    r = req(4, "mean")  # a mean of norm 0.5e-12, under the 1e-12 floor: divided by the floor
    finish_pooling(PoolPlan([0], [(r, 0, 4, True)]), torch.tensor([[0.3e-12, 0.4e-12]] * 4))
    assert r.embedding == pytest.approx([0.3, 0.4])


def test_last_pooling_takes_the_last_row_normalised() -> None:
    r, other = req(3, "last"), req(2, "last")
    hidden = torch.tensor([[1.0, 1.0], [3.0, 4.0], [0.0, 0.0]])
    finish_pooling(PoolPlan([0, 1, 2], [(r, 0, 2, True), (other, 2, 1, True)]), hidden)
    assert r.embedding == pytest.approx([0.6, 0.8]) and r.pooled_sum is None
    assert other.embedding == [0.0, 0.0]  # a zero vector stays zero (no division by zero)
    big = req(1, "last")
    finish_pooling(PoolPlan([0], [(big, 0, 1, True)]), torch.tensor([[3e-13, 4e-13]]))
    assert big.embedding == pytest.approx([0.3, 0.4])  # divided by the 1e-12 floor
    unfinished = req(1, "last")
    finish_pooling(PoolPlan([0], [(unfinished, 0, 1, False)]), torch.tensor([[3.0, 4.0]]))
    assert unfinished.embedding is None


def test_label_logprobs_over_the_whole_vocabulary() -> None:
    r = req(2, None)
    r.label_token_ids = [2, 0]
    logits = torch.tensor([1.0, 2.0, 3.0, 0.5], dtype=torch.bfloat16)
    record_label_logprobs(r, logits)
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert r.label_logprobs == pytest.approx([expected[2].item(), expected[0].item()], abs=1e-6)
    r.label_token_ids = None
    with pytest.raises(AssertionError):
        record_label_logprobs(r, logits)
