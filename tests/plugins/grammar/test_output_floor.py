"""The shortest-output reading of xgrammar's normalized grammars: endless rules are refused by
name, and the floor in bytes is a lower bound of every complete output."""

from __future__ import annotations

import json

import pytest

from radixserve.plugins.grammar.output_floor import Unparsed, output_floor, parse_rules

xgr = pytest.importorskip("xgrammar")

RECURSIVE_REQUIRED = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}


def schema_floor(schema: dict) -> int:
    return output_floor(str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)))


@pytest.mark.parametrize(
    "schema",
    [
        RECURSIVE_REQUIRED,
        {"$defs": RECURSIVE_REQUIRED["$defs"], "type": "array", "items": {"$ref": "#/$defs/n"}},
        {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"$ref": "#/$defs/n"}},
            "required": ["a", "b"],
            "$defs": RECURSIVE_REQUIRED["$defs"],
        },
    ],
)
def test_a_rule_that_can_never_complete_is_refused(schema: dict) -> None:
    with pytest.raises(ValueError, match="can never finish once it enters rule"):
        schema_floor(schema)


@pytest.mark.parametrize(
    "ebnf", ['root ::= "a" root', 'root ::= [a-z] r2\nr2 ::= "b" r2', 'root ::= ("x" root)+']
)
def test_an_endless_ebnf_is_refused(ebnf: str) -> None:
    with pytest.raises(ValueError, match="can never finish"):
        output_floor(str(xgr.Grammar.from_ebnf(ebnf)))


def test_optional_recursion_is_fine() -> None:
    optional = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}}
    assert schema_floor({**optional, "$ref": "#/$defs/n"}) == len("{}")


def test_the_floor_is_the_shortest_output() -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    assert schema_floor(schema) == len('{"name": "", "age": 0}')
    many = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
        "required": [f"p{i}" for i in range(5000)],
    }
    shortest = json.dumps({f"p{i}": 0 for i in range(5000)})
    assert schema_floor(many) == len(shortest)
    assert output_floor(str(xgr.Grammar.from_regex("[0-9]{3}-(ab|c)+"))) == 5
    assert output_floor(str(xgr.Grammar.from_ebnf('root ::= "ab" | "x" root'))) == 2


def test_structural_tags_are_read() -> None:
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<f"],
            "tags": [
                {
                    "begin": "<f>",
                    "content": {"type": "json_schema", "json_schema": {"type": "object"}},
                    "end": "</f>",
                }
            ],
        },
    }
    assert output_floor(str(xgr.Grammar.from_structural_tag(json.dumps(tag)))) == 0


def test_text_in_another_form_is_not_concluded_on() -> None:
    with pytest.raises(Unparsed):
        parse_rules("root = 'a'")
