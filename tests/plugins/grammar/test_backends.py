"""Each grammar backend on a tiny tokenizer: exact masks, rollback, termination, forced strings
and compile errors. The expected masks are computed by brute force over the vocabulary."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tiny_models import SPECIAL_TOKENS

from radixserve.core.interfaces import Grammar, GrammarBackend
from radixserve.core.plugins import default_host
from radixserve.core.tokenizer import Tokenizer
from radixserve.plugins.grammar.vocab import token_bytes

STOP = SPECIAL_TOKENS.index("<|endoftext|>")
WORDS = [b"cat", b"cats", b"dog", b"dogs"]
WORDS_REGEX = "(cat|dog)s?"


def allowed(backend: GrammarBackend, grammar: Grammar, vocab: int) -> set[int]:
    mask = backend.allocate_bitmask(3, vocab)
    mask[1].zero_()  # other rows must stay untouched
    grammar.fill_bitmask(mask, 2)
    assert (mask[0] == -1).all() and (mask[1] == 0).all()
    bits = (mask[2].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


def expected(tok: Tokenizer, done: bytes) -> set[int]:
    """Tokens that keep ``done + token`` a prefix of a word, and STOP when ``done`` is one."""
    spelled = token_bytes(tok, tok.vocab_size)
    out = {
        t
        for t, text in enumerate(spelled)
        if text and any(w.startswith(done + text) for w in WORDS)
    }
    return out | ({STOP} if done in WORDS else set())


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_bitmask_is_exact_at_every_step(backend: GrammarBackend, tiny_tokenizer: Tokenizer) -> None:
    vocab = tiny_tokenizer.vocab_size
    g = backend.compile("regex", WORDS_REGEX)
    done = b""
    assert allowed(backend, g, vocab) == expected(tiny_tokenizer, done)
    for token in ids(tiny_tokenizer, "dogs"):
        assert g.accept_token(token)
        done += token_bytes(tiny_tokenizer, vocab)[token] or b""
        assert allowed(backend, g, vocab) == expected(tiny_tokenizer, done), done


def test_rejected_token_leaves_state_unchanged(
    backend: GrammarBackend, tiny_tokenizer: Tokenizer
) -> None:
    vocab = tiny_tokenizer.vocab_size
    g = backend.compile("regex", WORDS_REGEX)
    assert g.accept_token(ids(tiny_tokenizer, "c")[0])
    before = allowed(backend, g, vocab)
    assert not g.accept_token(ids(tiny_tokenizer, "o")[0])
    assert not g.accept_token(STOP)  # "c" is not a word yet
    assert not g.accept_token(2)  # <|im_end|>: special, never text
    assert allowed(backend, g, vocab) == before
    assert g.accept_token(ids(tiny_tokenizer, "a")[0])


def test_rollback_undoes_exactly_k_tokens(
    backend: GrammarBackend, tiny_tokenizer: Tokenizer
) -> None:
    vocab = tiny_tokenizer.vocab_size
    g = backend.compile("regex", WORDS_REGEX)
    tokens = [*ids(tiny_tokenizer, "cats"), STOP]
    states = [(allowed(backend, g, vocab), g.is_terminated())]
    for token in tokens:
        assert g.accept_token(token)
        states.append((allowed(backend, g, vocab), g.is_terminated()))
    assert states[-1][1] and not states[-2][1]
    for k in (1, 2, 1):
        g.rollback(k)
        states = states[:-k]
        assert (allowed(backend, g, vocab), g.is_terminated()) == states[-1]
    g.rollback(0)
    assert (allowed(backend, g, vocab), g.is_terminated()) == states[-1]
    assert g.accept_token(ids(tiny_tokenizer, "a")[0])  # back on track after the rollbacks


def test_termination(backend: GrammarBackend, tiny_tokenizer: Tokenizer) -> None:
    g = backend.compile("regex", WORDS_REGEX)
    for token in ids(tiny_tokenizer, "dog"):
        assert g.accept_token(token) and not g.is_terminated()
    assert g.accept_token(STOP) and g.is_terminated()
    assert not g.accept_token(ids(tiny_tokenizer, "s")[0])
    assert allowed(backend, g, tiny_tokenizer.vocab_size) == set()
    assert g.forced_string() == ""


def test_copy_starts_fresh_and_is_independent(
    backend: GrammarBackend, tiny_tokenizer: Tokenizer
) -> None:
    g = backend.compile("regex", WORDS_REGEX)
    for token in ids(tiny_tokenizer, "cat"):
        assert g.accept_token(token)
    fresh = g.copy()
    assert allowed(backend, fresh, tiny_tokenizer.vocab_size) == expected(tiny_tokenizer, b"")
    assert fresh.accept_token(ids(tiny_tokenizer, "d")[0])
    assert g.accept_token(STOP) and not fresh.is_terminated()


@pytest.mark.parametrize(
    ("regex", "prefix", "forced"),
    [("@@@@[ab]", "", "@@@@"), ("x(abc|abd)", "x", "ab"), ("[ab]%%%%[cd]", "a", "%%%%")],
)
def test_forced_string(
    backend: GrammarBackend, tiny_tokenizer: Tokenizer, regex: str, prefix: str, forced: str
) -> None:
    g = backend.compile("regex", regex)
    for token in ids(tiny_tokenizer, prefix):
        assert g.accept_token(token)
    before = allowed(backend, g, tiny_tokenizer.vocab_size)
    assert g.forced_string() == forced
    assert allowed(backend, g, tiny_tokenizer.vocab_size) == before  # no state change


def test_json_schema_forces_keys(backend: GrammarBackend, tiny_tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    g = backend.compile("json_schema", json.dumps(schema))
    assert re.fullmatch(r'\{"name": ?"', g.forced_string())


def test_ebnf(backend: GrammarBackend, tiny_tokenizer: Tokenizer) -> None:
    grammar = 'root ::= "(" num ")"\nnum ::= [0-9] | [0-9] num'
    if backend.name == "outlines":  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="does not support ebnf"):
            backend.compile("ebnf", grammar)
        return
    g = backend.compile("ebnf", grammar)
    for token in ids(tiny_tokenizer, "(12)"):
        assert g.accept_token(token)
    assert g.accept_token(STOP) and g.is_terminated()


@pytest.mark.parametrize(
    ("kind", "spec", "problem"),
    [
        ("regex", "(ab", r"parenthes|unterminated|unclosed|missing \)"),
        ("json_schema", '{"type": "strin"}', "strin"),
        ("json_schema", "{not json", r"JSON|json|expected|syntax"),
        ("ebnf", 'root ::= "a" undefined_rule', r"undefined_rule|support"),
        ("cfg", "x", "unknown grammar kind 'cfg'"),
    ],
)
def test_compile_error_names_the_problem(
    backend: GrammarBackend, kind: str, spec: str, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        backend.compile(kind, spec)


@pytest.mark.parametrize("regex", [r"\p{L}+", r"[\p{Lu}][\p{Ll}]*"])
def test_unicode_class_regexes_compile(backend: GrammarBackend, regex: str) -> None:
    # Rust regex syntax (outlines-core, llguidance) and xgrammar's both accept Unicode classes;
    # no backend may refuse them for Python's `re`, which does not know \p.
    if backend.name == "xgrammar":  # type: ignore[attr-defined]
        pytest.skip("xgrammar's regex converter has no Unicode classes")
    backend.compile("regex", regex)


def test_batch_fill_matches_row_by_row(backend: GrammarBackend, tiny_tokenizer: Tokenizer) -> None:
    # fill_bitmasks may use the library's batch fill (xgrammar, llguidance's thread pool); each
    # row must equal the matcher's own fill, stop bits and terminated rows included.
    vocab = tiny_tokenizer.vocab_size
    grammars = [backend.compile("regex", WORDS_REGEX) for _ in range(4)]
    for g, text in zip(grammars, ["", "ca", "dogs", "cat"], strict=True):
        for token in ids(tiny_tokenizer, text):
            assert g.accept_token(token)
    assert grammars[3].accept_token(STOP) and grammars[3].is_terminated()
    rows = [(5, grammars[0]), (1, grammars[1]), (2, grammars[2]), (4, grammars[3])]
    batch = backend.allocate_bitmask(6, vocab)
    backend.fill_bitmasks(rows, batch)
    single = backend.allocate_bitmask(6, vocab)
    for row, g in rows:
        g.fill_bitmask(single, row)
    assert torch.equal(batch, single)
    assert (batch[0] == -1).all() and (batch[3] == -1).all()  # rows not named stay untouched


TAG_LEGACY = {
    "type": "structural_tag",
    "structures": [
        {
            "begin": "<f>",
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "end": "</f>",
        }
    ],
    "triggers": ["<f"],
}
TAG_FORMAT = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f"],
        "tags": [
            {
                "begin": "<f>",
                "content": {
                    "type": "json_schema",
                    "json_schema": TAG_LEGACY["structures"][0]["schema"],
                },
                "end": "</f>",
            }
        ],
    },
}


@pytest.mark.parametrize("tag", [TAG_LEGACY, TAG_FORMAT], ids=["structures", "triggered_tags"])
def test_structural_tag(backend: GrammarBackend, tiny_tokenizer: Tokenizer, tag: dict) -> None:
    if backend.name == "outlines":  # type: ignore[attr-defined]
        pytest.skip("outlines-core has no context-free grammars")
    if backend.name == "xgrammar" and "structures" in tag:  # type: ignore[attr-defined]
        pytest.skip("this xgrammar reads only the 'format' spelling")
    g = backend.compile("structural_tag", json.dumps(tag))
    for token in ids(tiny_tokenizer, 'Hi there <f>{"a": 12}</f> done'):
        assert g.accept_token(token), tiny_tokenizer.decode([token])
    assert g.accept_token(STOP)
    g = backend.compile("structural_tag", json.dumps(tag))
    for token in ids(tiny_tokenizer, "Hi <f>"):
        assert g.accept_token(token)
    assert not any(g.accept_token(t) for t in ids(tiny_tokenizer, "x"))  # JSON must follow


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"allOf": [OBJ, {"type": "object", "properties": {"b": {"type": "string"}}}]}, "allOf"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "integer", "not": {"const": 3}}, "not"),
        ({**OBJ, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"type": "array", "contains": {"const": 1}}, "contains"),
        ({**OBJ, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({**OBJ, "required": ["a", "zz"]}, "required names missing"),
    ],
)
def test_xgrammar_refuses_what_it_would_not_enforce(
    tiny_tokenizer: Tokenizer, schema: dict, keyword: str
) -> None:
    """xgrammar's converter takes these keywords and ignores them: outputs broke the schema and
    still ended with "stop". They are refused, named."""
    factory = default_host().registries["grammar"].get("xgrammar").factory
    xgrammar = factory(tiny_tokenizer, tiny_tokenizer.vocab_size, [STOP])
    with pytest.raises(ValueError, match=keyword):
        xgrammar.compile("json_schema", json.dumps(schema))
    # what it does enforce still compiles: one allOf branch, uniqueItems false
    xgrammar.compile("json_schema", json.dumps({"allOf": [OBJ]}))
    xgrammar.compile("json_schema", json.dumps({"type": "array", "uniqueItems": False}))
