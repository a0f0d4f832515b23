"""Grammar backend ``xgrammar`` (the default): JSON schema, regex, EBNF (GBNF) and structural
tags through the xgrammar library, with its C++ mask kernels."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Grammar, GrammarBackend
from radixserve.core.tokenizer import Tokenizer
from radixserve.plugins.grammar.output_floor import Unparsed, output_floor
from radixserve.plugins.grammar.schema_walk import map_schema
from radixserve.plugins.grammar.vocab import (
    encoded_vocab,
    special_token_ids,
    token_bytes,
    vocab_type,
)

logger = logging.getLogger(__name__)

# JSON-schema keywords xgrammar's converter accepts but does not enforce (outputs broke them and
# still ended with "stop"): refused, naming the keyword (with uniqueItems, a multi-schema allOf
# and required names missing from properties, _enforced).
_UNENFORCED = ("not", "if", "contains", "dependentRequired", "dependentSchemas", "dependencies")
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: " and check boilerplate.
_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


class XGrammarMatcher(Grammar):
    def __init__(self, compiled: Any, min_tokens: int = 0) -> None:
        import xgrammar as xgr

        self.compiled = compiled
        self.min_tokens = min_tokens
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        if self.matcher.is_terminated():  # xgrammar refuses to fill then; nothing is allowed
            bitmask[index].zero_()
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def forced_string(self) -> str:
        if self.matcher.is_terminated():
            return ""
        return str(self.matcher.find_jump_forward_string())

    def copy(self) -> Grammar:
        return XGrammarMatcher(self.compiled, self.min_tokens)

    def min_output_tokens(self) -> int:
        return self.min_tokens

    def memory_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes)


class XGrammarBackend(GrammarBackend):
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        import xgrammar as xgr

        vocab = encoded_vocab(tokenizer, vocab_size)
        # xgrammar treats "" as a special token: never allowed in text, only stop ids end it.
        for token_id in special_token_ids(tokenizer) - set(stop_token_ids):
            if token_id < vocab_size:
                vocab[token_id] = ""
        kind = vocab_type(tokenizer)
        info = xgr.TokenizerInfo(
            vocab,
            getattr(xgr.VocabType, kind.upper()),
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids) or None,
            # SentencePiece-style tokenizers prepend "▁" to the first word.
            add_prefix_space=kind == "byte_fallback",
        )
        # The engine caches compiled grammars itself (core/grammar_queue.py).
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)
        self.longest_token = max(
            (len(b) for b in token_bytes(tokenizer, vocab_size) if b), default=1
        )

    def compile(self, kind: str, spec: str) -> Grammar:
        import xgrammar as xgr

        try:
            if kind == "json_schema":
                _check_enforced(spec)
                # Compact JSON with fixed separators: no runaway whitespace, and keys and
                # punctuation become forced strings that jump-forward skips.
                grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=False)
            elif kind == "regex":
                grammar = xgr.Grammar.from_regex(spec)
            elif kind == "ebnf":
                grammar = xgr.Grammar.from_ebnf(spec)
            elif kind == "structural_tag":
                grammar = xgr.Grammar.from_structural_tag(spec)
            else:
                raise ValueError(f"unknown grammar kind '{kind}'")
            min_tokens = self._min_tokens(grammar)
            compiled = self.compiler.compile_grammar(grammar)
        except (RuntimeError, TypeError) as e:
            raise ValueError(_NOISE.sub("", str(e)).strip()) from e
        return XGrammarMatcher(compiled, min_tokens)

    def _min_tokens(self, grammar: Any) -> int:
        """Fewest tokens of a complete output; raises ValueError for a grammar with a rule that
        can never complete (its jump-forward text would be endless: xgrammar would grow it
        until memory runs out)."""
        try:
            floor = output_floor(str(grammar))
        except Unparsed as e:  # a form this xgrammar prints that we do not read: no bound
            logger.debug("no output floor for this grammar: %s", e)
            return 0
        return -(-floor // self.longest_token)

    def fill_bitmasks(self, grammars: Sequence[tuple[int, Grammar]], bitmask: torch.Tensor) -> None:
        live = [(r, g) for r, g in grammars if not g.is_terminated()]
        if len(live) < 2 or len(live) < len(grammars):
            super().fill_bitmasks(grammars, bitmask)
            return
        matchers = [g.matcher for _, g in live]  # type: ignore[attr-defined]
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, [r for r, _ in live])

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def _available() -> str | None:
    if importlib.util.find_spec("xgrammar") is None:
        return "the 'xgrammar' package is not installed (pip install xgrammar)"
    return None


@hookimpl
def register_grammar_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "xgrammar",
        XGrammarBackend,
        available=_available,
        description="xgrammar: JSON schema, regex, EBNF, structural tags",
    )


def _check_enforced(spec: str) -> None:
    """ValueError naming the first keyword of ``spec`` that xgrammar would not enforce."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError:
        return  # xgrammar names the problem itself
    map_schema(schema, _enforced)


def _enforced(node: dict[str, Any], path: str) -> dict[str, Any]:
    found = [key for key in _UNENFORCED if key in node]
    if node.get("uniqueItems"):
        found.append("uniqueItems")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        found.append("allOf with more than one schema")
    names = node.get("properties")
    if isinstance(names, dict) and isinstance(node.get("required"), list):
        if missing := [r for r in node["required"] if r not in names]:
            found.append(f"required names missing from properties ({missing[0]!r})")
    if found:
        raise ValueError(
            f"{found[0]} at {path} is not enforced by the xgrammar backend (outputs could break "
            "it); leave it out of the schema"
        )
    return node
