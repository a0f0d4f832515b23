"""Schema rewrites the grammar plugins apply: closed objects (llguidance, like xgrammar's strict
mode) and outlines' bounded-integer enums, refusing the bounds it cannot enforce."""

from __future__ import annotations

import json

import pytest

from radixserve.plugins.grammar.outlines_schema import enforceable_schema
from radixserve.plugins.grammar.schema_walk import closed_objects


def test_closed_objects_reaches_nested_subschemas_only() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "string"}}},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
            "open": {"properties": {"z": {}}, "additionalProperties": True},
        },
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["properties"]["additionalProperties"] is False  # a property named "properties"
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["properties"]["properties"]["x"]


def test_outlines_bounded_integers_become_enums() -> None:
    spec = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 3, "description": "years"},
            "n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3},
        },
    }
    props = enforceable_schema(json.dumps(spec))["properties"]
    assert props["age"] == {"description": "years", "enum": [0, 1, 2, 3]}
    assert props["n"] == {"enum": [1, 2]}


@pytest.mark.parametrize(
    ("node", "problem"),
    [
        (
            {"type": "number", "minimum": 0, "maximum": 1},
            "cannot enforce numeric bounds at #/properties/prop",
        ),
        ({"type": "integer", "minimum": 0}, "cannot enforce numeric bounds"),
        ({"type": "integer", "minimum": 0, "maximum": 10**6}, "under 1000 values"),
        (
            {"type": "array", "uniqueItems": True},
            "'uniqueItems' at #/properties/prop is not supported",
        ),
        # taken and ignored by outlines-core (outputs broke them): refused too
        ({"type": "object", "minProperties": 1}, "'minProperties'"),
        ({"type": "object", "maxProperties": 1}, "'maxProperties'"),
        ({"type": "object", "propertyNames": {"maxLength": 2}}, "'propertyNames'"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' of several schemas"),
    ],
)
def test_outlines_refuses_what_it_cannot_enforce(node: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        enforceable_schema(json.dumps({"properties": {"prop": node}}))


def test_outlines_bad_json() -> None:
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        enforceable_schema("{nope")


def test_outlines_draft4_boolean_exclusive_bounds() -> None:
    draft4 = {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 3}
    assert enforceable_schema(json.dumps(draft4)) == {"enum": [1, 2, 3]}
    both = {**draft4, "exclusiveMaximum": True}
    assert enforceable_schema(json.dumps(both)) == {"enum": [1, 2]}
    off = {**draft4, "exclusiveMinimum": False, "exclusiveMaximum": False}
    assert enforceable_schema(json.dumps(off)) == {"enum": [0, 1, 2, 3]}
    with pytest.raises(ValueError, match="cannot enforce numeric bounds"):
        enforceable_schema(json.dumps({"type": "integer", "exclusiveMinimum": True}))


OBJ = {"properties": {"a": {}}}  # closed_objects adds additionalProperties: false to it


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"propertyNames": OBJ}, ("propertyNames",)),
        ({"dependentSchemas": {"a": OBJ}}, ("dependentSchemas", "a")),
        ({"dependencies": {"a": OBJ, "b": ["a"]}}, ("dependencies", "a")),
        ({"unevaluatedProperties": OBJ}, ("unevaluatedProperties",)),
        ({"unevaluatedItems": OBJ}, ("unevaluatedItems",)),
        ({"additionalItems": OBJ}, ("additionalItems",)),
        ({"items": [{}, OBJ]}, ("items", 1)),
        ({"items": OBJ}, ("items",)),
    ],
)
def test_every_subschema_keyword_is_walked(schema: dict, where: tuple) -> None:
    node = closed_objects(schema)
    for key in where:
        node = node[key]
    assert node["additionalProperties"] is False
    if "dependencies" in schema:  # a list of property names is left alone
        assert closed_objects(schema)["dependencies"]["b"] == ["a"]
