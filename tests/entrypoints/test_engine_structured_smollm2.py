"""Structured outputs from SmolLM2 for each grammar backend: 50 outputs for 10 JSON schemas
validate with ``jsonschema``, 30 regex outputs fullmatch, an EBNF output parses, and
jump-forward takes fewer model steps than output tokens."""

from __future__ import annotations

import ast
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from radixserve import Engine

pytestmark = pytest.mark.slow

BACKENDS = ["xgrammar", "outlines", "llguidance"]
NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
        },
    ),
    (
        "a product in a shop",
        {
            "type": "object",
            "properties": {
                "product": NAME,
                "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                "in_stock": {"type": "boolean"},
            },
            "required": ["product", "quantity", "in_stock"],
        },
    ),
    (
        "a T-shirt",
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            },
            "required": ["color", "size"],
        },
    ),
    (
        "a blog post's tags",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[a-z]{2,10}$"},
                    "minItems": 1,
                    "maxItems": 4,
                }
            },
            "required": ["tags"],
        },
    ),
    (
        "a user account",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 500},
                        "email": {"type": "string", "pattern": "^[a-z]{2,10}@[a-z]{2,8}\\.com$"},
                    },
                    "required": ["id", "email"],
                },
                "active": {"type": "boolean"},
            },
            "required": ["user", "active"],
        },
    ),
    (
        "a book, with a subtitle and year if you know them",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 30},
                "subtitle": {"type": "string", "maxLength": 30},
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            },
            "required": ["title"],
        },
    ),
    (
        "a shopping list",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": NAME,
                            "count": {"type": "integer", "minimum": 0, "maximum": 50},
                        },
                        "required": ["name", "count"],
                    },
                }
            },
            "required": ["items"],
        },
    ),
    (
        "an event with a date",
        {
            "type": "object",
            "properties": {
                "event": NAME,
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                "day": {"enum": ["Monday", "Friday", "Sunday"]},
            },
            "required": ["event", "date", "day"],
        },
    ),
    (
        "a player, nickname optional (null if none)",
        {
            "type": "object",
            "properties": {
                "nickname": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
                "score": {"type": "integer", "minimum": 0, "maximum": 10},
            },
            "required": ["nickname", "score"],
        },
    ),
    (
        "an order",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
                "customer": {
                    "type": "object",
                    "properties": {"name": NAME, "vip": {"type": "boolean"}},
                    "required": ["name", "vip"],
                },
                "lines": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["sku", "qty"],
                    },
                },
            },
            "required": ["order_id", "customer", "lines"],
        },
    ),
]
REGEXES = [
    ("a US phone number", r"\(\d{3}\) \d{3}-\d{4}"),
    ("a date", r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("an email address", r"[a-z]{3,10}@[a-z]{3,10}\.(com|org|net)"),
    ("yes or no, and why", r"(Yes|No), because [a-z ]{5,40}\."),
    ("a time of day", r"([01]\d|2[0-3]):[0-5]\d (AM|PM)"),
]
EBNF = """root ::= term (op term (op term (op term)?)?)?
op ::= " + " | " - " | " * "
term ::= num | "(" num op num ")"
num ::= [1-9] [0-9]?"""
SAMPLING = {"temperature": 0.8}


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest, smollm2_dir: Path):
    with Engine(
        str(smollm2_dir), plugins=[f"grammar={request.param}"], max_total_tokens=16384
    ) as eng:
        # Cache the chat template's system prompt once, so the batches below share its prefill.
        eng.generate(chat(eng, "Hi"), {"max_new_tokens": 0})
        yield eng


def chat(engine: Engine, task: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": task}])


def run_all(engine: Engine, calls: list[tuple[list[str], dict[str, Any]]]) -> list[list[Any]]:
    """One generate call per (prompts, params), all submitted at once to share batches."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(engine.generate, p, params) for p, params in calls]
        return [f.result() for f in futures]


def test_fifty_json_outputs_validate(engine: Engine) -> None:
    calls = []
    for what, schema in SCHEMAS:
        prompt = chat(engine, f"Describe {what} as JSON.")
        params = {"json_schema": json.dumps(schema), "max_new_tokens": 160, **SAMPLING}
        calls.append(([prompt] * 5, params))
    results = run_all(engine, calls)
    assert sum(len(outs) for outs in results) == 50
    for (_, schema), outs in zip(SCHEMAS, results, strict=True):
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            jsonschema.validate(json.loads(out["text"]), schema)
    engine.core.scheduler.check_no_leak()


def test_thirty_regex_outputs_fullmatch(engine: Engine) -> None:
    calls = []
    for what, regex in REGEXES:
        prompt = chat(engine, f"Give me {what}.")
        calls.append(([prompt] * 6, {"regex": regex, "max_new_tokens": 64, **SAMPLING}))
    results = run_all(engine, calls)
    assert sum(len(outs) for outs in results) == 30
    for (_, regex), outs in zip(REGEXES, results, strict=True):
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            assert re.fullmatch(regex, out["text"]), (regex, out["text"])


def test_ebnf_output_parses(engine: Engine) -> None:
    prompt = chat(engine, "Write a short arithmetic expression.")
    params = {"ebnf": EBNF, "max_new_tokens": 64, **SAMPLING}
    if engine.core.grammars.backend_name == "outlines":
        out = engine.generate(prompt, params)
        assert "does not support ebnf" in out["meta_info"]["finish_reason"]["message"]
        pytest.skip("outlines-core has no context-free grammars (EBNF); refused with a reason")
    outs = engine.generate([prompt] * 4, params)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        ast.parse(out["text"], mode="eval")  # a Python expression parser agrees
        assert re.fullmatch(r"[0-9()+\-* ]+", out["text"]), out["text"]


def test_jump_forward_takes_fewer_steps_than_tokens(engine: Engine) -> None:
    schema = SCHEMAS[-1][1]
    prompt = chat(engine, "Describe an order as JSON.")
    before = engine.core.scheduler.stats.steps
    out = engine.generate(prompt, {"json_schema": json.dumps(schema), "temperature": 0})
    steps = engine.core.scheduler.stats.steps - before
    jsonschema.validate(json.loads(out["text"]), schema)
    assert steps < len(out["output_ids"]) * 0.75, (steps, len(out["output_ids"]))
