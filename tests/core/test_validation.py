"""core/validation.py: the one request check the server and the engine both run."""

from __future__ import annotations

import pytest

from radixserve.core.request import InvalidRequest, SamplingParams
from radixserve.core.validation import ServingLimits, check_request, fit_output_budget

LIMITS = ServingLimits(vocab_size=100, max_context=64, kv_tokens=48)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "the prompt is empty; send at least one token"),
        ([1, 100], "token id 100 is outside the vocabulary [0, 100)"),
        ([-1], "token id -1 is outside the vocabulary [0, 100)"),
        ([1] * 64, "the prompt has 64 tokens; this model's context length is 64"),
        ([1] * 48, "the prompt has 48 tokens; the KV pool holds 48"),
    ],
)
def test_prompts_that_cannot_be_served(ids: list[int], message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_request(ids, SamplingParams(), LIMITS)
    assert str(err.value) == message


def test_the_prompt_is_checked_before_the_params() -> None:
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        check_request([], SamplingParams(top_p=0), LIMITS)
    with pytest.raises(InvalidRequest, match=r"top_p must be in \(0, 1\]"):
        check_request([1], SamplingParams(top_p=0), LIMITS)


def test_a_budget_past_the_context_is_refused_only_when_the_client_named_it() -> None:
    params = SamplingParams(max_new_tokens=60)
    check_request([1] * 10, params, LIMITS)  # ends with "length" instead
    with pytest.raises(InvalidRequest) as err:
        check_request([1] * 10, params, LIMITS, max_field="max_tokens")
    assert str(err.value) == (
        "max_tokens=60 plus the prompt's 10 tokens exceeds this model's context length of 64 tokens"
    )


@pytest.mark.parametrize(
    ("pooling", "labels", "message"),
    [
        ("max", None, "pooling must be one of ('last', 'mean'), got 'max'"),
        (None, [], "label_token_ids must be token ids in [0, 100)"),
        (None, [5, 100], "label_token_ids must be token ids in [0, 100)"),
    ],
)
def test_bad_pooling_and_labels(pooling: str | None, labels: list[int] | None, message: str):
    with pytest.raises(InvalidRequest) as err:
        check_request([1], SamplingParams(), LIMITS, pooling=pooling, label_token_ids=labels)
    assert str(err.value) == message
    check_request([1], SamplingParams(), LIMITS, pooling="mean", label_token_ids=[5, 99])


def test_the_output_budget_is_cut_to_the_kv_pool() -> None:
    params = SamplingParams(max_new_tokens=100, min_new_tokens=45)
    cut = fit_output_budget(params, 10, LIMITS.kv_tokens)
    assert (cut.max_new_tokens, cut.min_new_tokens) == (38, 38)
    assert params.max_new_tokens == 100  # a copy: the caller's params are left alone
    fits = SamplingParams(max_new_tokens=38)
    assert fit_output_budget(fits, 10, LIMITS.kv_tokens) is fits


def test_token_id_zero_and_the_context_boundary_are_served() -> None:
    check_request([0, 5], SamplingParams(), LIMITS)  # id 0 is in the vocabulary
    check_request([1], SamplingParams(), LIMITS, label_token_ids=[0, 99])
    # the prompt and the named budget may fill the context exactly
    check_request([1] * 10, SamplingParams(max_new_tokens=54), LIMITS, max_field="max_tokens")
    with pytest.raises(InvalidRequest, match="max_tokens=55 plus the prompt's 10 tokens"):
        check_request([1] * 10, SamplingParams(max_new_tokens=55), LIMITS, max_field="max_tokens")


def test_the_params_are_checked_against_the_vocabulary() -> None:
    with pytest.raises(InvalidRequest, match="top_logprobs_num must be <= the vocabulary size"):
        check_request([1], SamplingParams(top_logprobs_num=101), LIMITS)
    check_request([1], SamplingParams(top_logprobs_num=100), LIMITS)


def test_the_default_seed_goes_to_requests_without_one() -> None:
    seeded = LIMITS._replace(default_seed=7)
    params = SamplingParams()
    check_request([1], params, seeded)
    assert params.seed == 7
    own = SamplingParams(seed=3)
    check_request([1], own, seeded)
    assert own.seed == 3
    unseeded = SamplingParams()
    check_request([1], unseeded, LIMITS)
    assert unseeded.seed is None
