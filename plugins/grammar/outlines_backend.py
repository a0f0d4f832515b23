"""Grammar backend ``outlines``: JSON schema and regex through outlines-core's token-level DFA.

outlines-core has no EBNF and no structural tags, and its JSON-schema converter ignores numeric
bounds; this backend refuses what it cannot enforce instead of producing unchecked output
(small bounded integer ranges are rewritten to an enum, which it does enforce).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Grammar, GrammarBackend
from radixserve.core.tokenizer import Tokenizer
from radixserve.plugins.grammar.outlines_schema import enforceable_schema
from radixserve.plugins.grammar.stop_matcher import StopTokenMatcher
from radixserve.plugins.grammar.vocab import token_bytes

MAX_ROLLBACK = 64
FORCED_MAX_TOKENS = 32  # a state with more allowed tokens forces nothing worth computing


class CompiledIndex:
    """An outlines-core Index plus, per DFA state, the bytes every continuation starts with."""

    def __init__(self, index: Any, token_bytes: list[bytes | None], stops: frozenset[int]) -> None:
        self.index = index
        self.token_bytes = token_bytes
        self.stops = stops
        self._forced: dict[int, tuple[bytes, int | None]] = {}

    def forced_step(self, state: int) -> tuple[bytes, int | None]:
        """(forced bytes from ``state``, the state after them or None if no token spells them)."""
        step = self._forced.get(state)
        if step is None:
            step = self._forced[state] = self._compute(state)
        return step

    def _compute(self, state: int) -> tuple[bytes, int | None]:
        allowed = self.index.get_allowed_tokens(state) or []
        if not allowed or len(allowed) > FORCED_MAX_TOKENS or self.stops & set(allowed):
            return b"", None
        spelled = [(self.token_bytes[t] or b"", t) for t in allowed]
        common = os.path.commonprefix([text for text, _ in spelled])
        exact = [t for text, t in spelled if text == common]
        if not common or not exact:
            return common, None
        return common, self.index.get_next_state(state, exact[0])


class OutlinesMatcher(StopTokenMatcher):
    def __init__(self, compiled: CompiledIndex) -> None:
        import outlines_core

        super().__init__(compiled.stops)
        self.compiled = compiled
        self.guide = outlines_core.Guide(compiled.index, max_rollback=MAX_ROLLBACK)

    def _advance(self, token_id: int) -> bool:
        try:
            self.guide.advance(token_id, return_tokens=False)
        except ValueError:  # "No next state found ..."; the state is unchanged
            return False
        return True

    def _undo(self, num_tokens: int) -> None:
        self.guide.rollback_state(num_tokens)

    def _can_stop(self) -> bool:
        return bool(self.guide.is_finished())

    def _fill_row(self, row: torch.Tensor) -> None:
        self.guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def forced_string(self) -> str:
        if self.terminated:
            return ""
        out = b""
        state: int | None = self.guide.get_state()
        while state is not None and len(out) < 256:
            piece, state = self.compiled.forced_step(state)
            out += piece
        return _whole_chars(out)

    def copy(self) -> Grammar:
        return OutlinesMatcher(self.compiled)


class OutlinesBackend(GrammarBackend):
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        import outlines_core

        self.stops = frozenset(stop_token_ids)
        self.token_bytes = token_bytes(tokenizer, vocab_size)
        spellings: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(self.token_bytes):
            if text and token_id not in self.stops:
                spellings.setdefault(text, []).append(token_id)
        eos = min(self.stops) if self.stops else vocab_size - 1
        self.vocabulary = outlines_core.Vocabulary(eos, spellings)

    def compile(self, kind: str, spec: str) -> Grammar:
        import outlines_core

        if kind == "json_schema":
            schema = json.dumps(enforceable_schema(spec))
            try:
                # No optional whitespace: compact JSON, whose keys jump-forward can skip.
                regex = outlines_core.json_schema.build_regex_from_schema(schema, "")
            except (TypeError, ValueError) as e:
                raise ValueError(f"outlines-core cannot convert this schema: {e}") from e
        elif kind == "regex":
            regex = spec  # Rust regex syntax (outlines-core's): \p{L} and the like are fine
        elif kind in ("ebnf", "structural_tag"):
            raise ValueError(
                f"the outlines backend does not support {kind} (outlines-core has no "
                "context-free grammars); use --plugin grammar=xgrammar or llguidance"
            )
        else:
            raise ValueError(f"unknown grammar kind '{kind}'")
        try:
            index = outlines_core.Index(regex, self.vocabulary)
        except ValueError as e:
            raise ValueError(
                f"outlines-core cannot build an automaton for it: {e}{_regex_hint(regex)}"
            ) from e
        return OutlinesMatcher(CompiledIndex(index, self.token_bytes, self.stops))


def _regex_hint(regex: str) -> str:
    # outlines-core does not say what is wrong with a regex it cannot parse; Python's parser
    # often can (it only explains a refusal, it never refuses: the syntaxes differ).
    try:
        re.compile(regex)
    except re.error as e:
        return f" (Python's regex parser: {e})"
    return ""


def _whole_chars(data: bytes) -> str:
    """``data`` decoded, cut before an incomplete trailing UTF-8 character."""
    for end in range(len(data), max(len(data) - 4, 0) - 1, -1):
        try:
            return data[:end].decode()
        except UnicodeDecodeError:
            continue
    return ""


def _available() -> str | None:
    if importlib.util.find_spec("outlines_core") is None:
        return "the 'outlines-core' package is not installed (pip install outlines-core)"
    return None


@hookimpl
def register_grammar_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "outlines",
        OutlinesBackend,
        available=_available,
        description="outlines-core: JSON schema, regex (no EBNF)",
    )
