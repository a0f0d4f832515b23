"""select() scoring methods on hand-made logprob entries."""

from __future__ import annotations

import pytest

from radixserve.lang.choices import (
    ChoicesDecision,
    ChoicesMethod,
    Entry,
    choices_method,
    greedy_matrix,
    greedy_token_selection,
    mean_logprob,
    strip_unhealed_token,
    token_length_normalized,
    unconditional_likelihood_normalized,
)


def row(*logprobs: float | None) -> list[Entry]:
    return [[lp, i, f"t{i}"] for i, lp in enumerate(logprobs)]


def decide(
    method: ChoicesMethod, rows: list[list[Entry]], uncond: list[list[Entry]] | None = None
) -> ChoicesDecision:
    return method(
        choices=[f"c{i}" for i in range(len(rows))],
        normalized_prompt_logprobs=[mean_logprob(r) for r in rows],
        input_token_logprobs=rows,
        output_token_logprobs=[[] for _ in rows],
        unconditional_token_logprobs=uncond,
    )


def test_mean_ignores_null_logprobs() -> None:
    assert mean_logprob(row(None, -1.0, -3.0)) == -2.0
    assert mean_logprob([]) == float("-inf")


def test_token_length_normalized_prefers_the_best_mean_not_the_best_sum() -> None:
    short = row(-1.5)  # sum -1.5, mean -1.5
    long = row(-1.0, -1.0, -1.0)  # sum -3.0, mean -1.0
    d = decide(token_length_normalized, [short, long])
    assert d.decision == "c1"
    assert d.meta_info["normalized_prompt_logprobs"] == [-1.5, -1.0]


def test_greedy_goes_token_by_token_and_pads_short_choices_with_their_mean() -> None:
    a = row(-0.1, -5.0)  # best first token, bad second
    b = row(-0.1, -0.2, -9.0)  # same first token, better second; worst mean
    c = row(-0.5)
    assert greedy_matrix([a, c]) == [[-0.1, -5.0], [-0.5, -0.5]]
    d = decide(greedy_token_selection, [a, b, c])
    assert d.decision == "c1"
    assert decide(token_length_normalized, [a, b, c]).decision == "c2"


def test_unconditional_normalization_subtracts_the_choice_alone() -> None:
    common = row(-1.0, -1.0)  # likely in context, but likely anyway
    rare = row(-2.0, -2.0)  # less likely in context, far less likely alone
    uncond = [row(None, -0.5), row(None, -4.0)]  # first token: nothing predicts it -> 0
    d = decide(unconditional_likelihood_normalized, [common, rare], uncond)
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == [-0.75, 0.0]
    assert d.decision == "c1"
    with pytest.raises(ValueError, match="needs the unconditional"):
        decide(unconditional_likelihood_normalized, [common])
    with pytest.raises(ValueError, match="token counts differ"):
        decide(unconditional_likelihood_normalized, [common], [row(None)])


def test_the_first_entry_is_dropped_only_when_it_is_plain_prefix_text() -> None:
    entries = [[-0.3, 1, " is"], [-0.2, 2, " Paris"]]
    assert strip_unhealed_token("The capital is", entries) == entries[1:]
    healed = [[-0.3, 1, " Par"], [-0.2, 2, "is"]]
    assert strip_unhealed_token("The capital is Par", healed) == healed[1:]
    assert strip_unhealed_token("The capital is", healed) == healed


def test_methods_by_name() -> None:
    assert choices_method(None) is token_length_normalized
    assert choices_method("greedy") is greedy_token_selection
    assert (
        choices_method(unconditional_likelihood_normalized) is unconditional_likelihood_normalized
    )
    with pytest.raises(ValueError, match="available: token_length_normalized, greedy"):
        choices_method("nope")
