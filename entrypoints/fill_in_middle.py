"""Fill-in-the-middle prompts for /v1/completions ``suffix``, from the FIM tokens the model's
vocabulary has. SGLang builds the same prompts from a completion template chosen by flag
(star_coder, qwen_coder, deepseek_coder); here the vocabulary picks it, so a model without FIM
tokens refuses ``suffix`` rather than silently dropping it."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class FimTokens(NamedTuple):
    """The three markers, in the order the prompt puts them: begin, <prompt>, hole, <suffix>,
    end, and the model writes the middle."""

    begin: str
    hole: str
    end: str


# prefix-suffix-middle order, as the models were trained
FIM_FAMILIES = (
    FimTokens("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SmolLM2
    FimTokens("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    FimTokens("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def find_fim_tokens(token_to_id: Callable[[str], int | None]) -> FimTokens | None:
    """The first family whose three markers are all single tokens of the vocabulary."""
    for family in FIM_FAMILIES:
        if all(token_to_id(t) is not None for t in family):
            return family
    return None


def fim_prompt(tokens: FimTokens, prefix: str, suffix: str) -> str:
    return f"{tokens.begin}{prefix}{tokens.hole}{suffix}{tokens.end}"
