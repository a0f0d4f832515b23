"""select() scoring from input-token logprobs, as SGLang's frontend computes it.

A backend scores each ``prefix + choice`` with teacher forcing and hands the methods here the
logprob entries ``[logprob, token_id, token_text]`` of each choice's tokens (PROTOCOL.md):

- ``token_length_normalized`` (default): the highest mean logprob per token;
- ``greedy``: compare token by token, keeping the choices with the best logprob at each
  position (a shorter choice is padded with its own mean);
- ``unconditional_likelihood_normalized``: the highest mean of (conditional logprob minus the
  logprob of the same token when the choice is scored alone, with no prefix).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Entry = Sequence[Any]  # [logprob | None, token_id, token_text | None]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChoiceScores:
    """What a backend measured for each choice (entries without the unhealed prefix token)."""

    choices: list[str]
    normalized_prompt_logprobs: list[float]
    input_token_logprobs: list[list[Entry]]
    output_token_logprobs: list[list[Entry]]
    unconditional_token_logprobs: list[list[Entry]] | None = None


class ChoicesMethod(ABC):
    """Picks one choice from per-choice logprob entries (SGLang's keyword interface)."""

    name: str = ""
    requires_unconditional_logprobs: bool = False

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Entry]],
        output_token_logprobs: list[list[Entry]],
        unconditional_token_logprobs: list[list[Entry]] | None = None,
    ) -> ChoicesDecision:
        if not choices:
            raise ValueError("select() needs at least one choice")
        scores = ChoiceScores(
            choices,
            normalized_prompt_logprobs,
            input_token_logprobs,
            output_token_logprobs,
            unconditional_token_logprobs,
        )
        index, extra = self.pick(scores)
        meta = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            **extra,
        }
        return ChoicesDecision(choices[index], meta)

    @abstractmethod
    def pick(self, scores: ChoiceScores) -> tuple[int, dict[str, Any]]:
        """The index of the chosen choice and extra meta_info entries."""

    def __repr__(self) -> str:
        return self.name


def mean_logprob(entries: Sequence[Entry]) -> float:
    """The mean of the non-null logprobs (``-inf`` when there are none)."""
    values = [e[0] for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


def strip_unhealed_token(prefix: str, entries: list[Entry]) -> list[Entry]:
    """Scoring starts one token early (the prefix's second-to-last token) so that a choice
    that re-tokenizes the end of the prefix ("token healing") is scored with it. When the
    first entry is still plain prefix text, it is dropped."""
    if entries and isinstance(entries[0][2], str) and prefix.endswith(entries[0][2]):
        return entries[1:]
    return entries


def _first_best(values: Sequence[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


class TokenLengthNormalized(ChoicesMethod):
    name = "token_length_normalized"

    def pick(self, scores: ChoiceScores) -> tuple[int, dict[str, Any]]:
        return _first_best(scores.normalized_prompt_logprobs), {}


class GreedyTokenSelection(ChoicesMethod):
    name = "greedy"

    def pick(self, scores: ChoiceScores) -> tuple[int, dict[str, Any]]:
        matrix = greedy_matrix(scores.input_token_logprobs)
        remaining = list(range(len(scores.choices)))
        for j in range(len(matrix[0]) if matrix else 0):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return remaining[0], {"greedy_logprob_matrix": matrix}


def greedy_matrix(per_choice: list[list[Entry]]) -> list[list[float]]:
    """One row of logprobs per choice, shorter rows padded with their own mean."""
    width = max((len(row) for row in per_choice), default=0)
    rows = []
    for entries in per_choice:
        values = [e[0] if e[0] is not None else float("-inf") for e in entries]
        pad = sum(values) / len(values) if values else float("nan")
        rows.append(values + [pad] * (width - len(values)))
    return rows


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def pick(self, scores: ChoiceScores) -> tuple[int, dict[str, Any]]:
        uncond = scores.unconditional_token_logprobs
        if uncond is None:
            raise ValueError(f"{self.name} needs the unconditional token logprobs")
        values = [
            unconditional_score(c, u)
            for c, u in zip(scores.input_token_logprobs, uncond, strict=True)
        ]
        extra = {
            "unconditional_token_logprobs": uncond,
            "normalized_unconditional_prompt_logprobs": values,
        }
        return _first_best(values), extra


def unconditional_score(cond: Sequence[Entry], uncond: Sequence[Entry]) -> float:
    """Mean of conditional minus unconditional logprob; the unconditional first token has no
    logprob (nothing predicts it) and counts as 0."""
    if len(cond) != len(uncond):
        raise ValueError(
            f"conditional ({len(cond)}) and unconditional ({len(uncond)}) token counts differ"
        )
    if not cond:
        return float("-inf")
    diffs = [
        (c[0] if c[0] is not None else float("-inf")) - (u[0] if u[0] is not None else 0.0)
        for c, u in zip(cond, uncond, strict=True)
    ]
    return sum(diffs) / len(diffs)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

METHODS: dict[str, ChoicesMethod] = {
    m.name: m
    for m in (token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)
}


def choices_method(value: ChoicesMethod | str | None) -> ChoicesMethod:
    """A method object from itself, its name, or None (the default)."""
    if value is None:
        return token_length_normalized
    if isinstance(value, ChoicesMethod):
        return value
    if value in METHODS:
        return METHODS[value]
    raise ValueError(f"unknown choices_method {value!r}; available: {', '.join(METHODS)}")
