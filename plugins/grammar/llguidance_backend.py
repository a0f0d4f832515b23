"""Grammar backend ``llguidance``: JSON schema, regex, EBNF (GBNF, converted to Lark) and Lark
through Microsoft's llguidance (Earley parser over a lexer; masks computed on the fly)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Grammar, GrammarBackend
from radixserve.core.tokenizer import Tokenizer
from radixserve.plugins.grammar.schema_walk import closed_objects
from radixserve.plugins.grammar.stop_matcher import StopTokenMatcher

# Compact JSON with fixed separators, like the xgrammar backend: keys become forced strings.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher(StopTokenMatcher):
    def __init__(self, template: Any, stops: frozenset[int]) -> None:
        super().__init__(stops)
        self.template = template  # the compiled grammar's matcher, never advanced
        self.matcher = template.deep_copy()

    def _advance(self, token_id: int) -> bool:
        # NOTE: a rejected token puts an LLMatcher in a permanent error state, so check first.
        if self.matcher.validate_tokens([token_id]) != 1:
            return False
        return bool(self.matcher.consume_token(token_id))

    def _undo(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def _can_stop(self) -> bool:
        return bool(self.matcher.is_accepting())

    def _fill_row(self, row: torch.Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def forced_string(self) -> str:
        if self.terminated:
            return ""
        forced = bytes(self.matcher.compute_ff_bytes())
        return forced.decode("utf-8", errors="ignore")

    def copy(self) -> Grammar:
        return LLGuidanceMatcher(self.template, self.stop_token_ids)


class LLGuidanceBackend(GrammarBackend):
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        import llguidance

        self.stops = frozenset(stop_token_ids)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(self.stops) or None
        )
        self.executor = llguidance.LLExecutor()  # its thread pool for batch mask fills

    def fill_bitmasks(self, grammars: Sequence[tuple[int, Grammar]], bitmask: torch.Tensor) -> None:
        """All live rows in one call of llguidance's parallel fill (its thread pool, no GIL)."""
        live = [(row, g) for row, g in grammars if not g.is_terminated()]
        if len(live) < 2 or not bitmask.is_contiguous():
            super().fill_bitmasks(grammars, bitmask)
            return
        from llguidance.torch import fill_next_token_bitmask_par

        matchers = [(g.matcher, row) for row, g in live]  # type: ignore[attr-defined]
        fill_next_token_bitmask_par(self.executor, matchers, bitmask)
        for row, g in grammars:
            if g.is_terminated():
                bitmask[row].zero_()
            else:
                g.fix_stop_bits(bitmask[row])  # type: ignore[attr-defined]

    def compile(self, kind: str, spec: str) -> Grammar:
        import llguidance

        build = llguidance.LLMatcher
        try:
            if kind == "json_schema":
                schema = closed_objects(json.loads(spec))
                grammar = build.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
            elif kind == "regex":
                grammar = build.grammar_from_regex(spec)
            elif kind == "ebnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = build.grammar_from_lark(gbnf_to_lark(spec))
            elif kind == "structural_tag":
                grammar = build.grammar_from_lark(structural_tag_lark(spec))
            else:
                raise ValueError(f"unknown grammar kind '{kind}'")
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from e
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - llguidance and its GBNF converter raise own types
            raise ValueError(f"{type(e).__name__}: {e}") from e
        template = build(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        return LLGuidanceMatcher(template, self.stops)


def structural_tag_lark(spec: str) -> str:
    """A structural tag (free text in which each trigger starts a tagged JSON segment) as
    llguidance's Lark, through its own ``StructTag``. Both spellings SGLang accepts: ``{"type":
    "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}`` and
    xgrammar's ``{"format": {"type": "triggered_tags", "triggers", "tags": [{"begin",
    "content": {"type": "json_schema", "json_schema"}, "end"}]}}``."""
    import llguidance

    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"structural_tag is not valid JSON: {e}") from e
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be a JSON object")
    fmt = tag.get("format")
    if isinstance(fmt, dict):
        if fmt.get("type") != "triggered_tags":
            raise ValueError(
                f"the llguidance backend reads structural tags of format 'triggered_tags', not "
                f"{fmt.get('type')!r}; use --plugin grammar=xgrammar"
            )
        triggers, items = fmt.get("triggers"), fmt.get("tags")
        segments = []
        for item in items if isinstance(items, list) else []:
            content = item.get("content") if isinstance(item, dict) else None
            if not isinstance(content, dict) or content.get("type") != "json_schema":
                raise ValueError(
                    "the llguidance backend reads tags whose content is a json_schema; use "
                    "--plugin grammar=xgrammar"
                )
            segments.append((item.get("begin"), content.get("json_schema"), item.get("end")))
    else:
        triggers, items = tag.get("triggers"), tag.get("structures")
        segments = [
            (s.get("begin"), s.get("schema"), s.get("end"))
            for s in (items if isinstance(items, list) else [])
            if isinstance(s, dict)
        ]
    if not isinstance(triggers, list) or not segments:
        raise ValueError("structural_tag needs 'triggers' and at least one tag")
    tags = []
    for begin, schema, end in segments:
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ValueError("each structural tag needs 'begin' and 'end' strings")
        trigger = next((t for t in triggers if isinstance(t, str) and begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger starts the tag begin {begin!r}")
        schema = closed_objects(schema if schema is not None else {})
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    # Triggers are text here (assume_special=False): "<tool_call>" need not be one token.
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def _available() -> str | None:
    if importlib.util.find_spec("llguidance") is None:
        return "the 'llguidance' package is not installed (pip install llguidance)"
    return None


@hookimpl
def register_grammar_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "llguidance",
        LLGuidanceBackend,
        available=_available,
        description="llguidance: JSON schema, regex, EBNF/Lark, structural tags",
    )
