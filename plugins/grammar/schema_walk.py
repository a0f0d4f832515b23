"""Walk a JSON schema's subschemas (not its property names or enum values), rewriting each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Rewrite = Callable[[dict[str, Any], str], dict[str, Any]]

# Every keyword whose value holds subschemas (JSON Schema 2020-12, and draft 4-7 spellings):
# a map of name -> subschema, one subschema, or a list of them. "items" is one subschema or
# (draft 4-2019) a list; draft-4 "dependencies" maps a property to a subschema or to a list of
# property names (the names are not walked).
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "contains",
)
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def map_schema(node: Any, rewrite: Rewrite, path: str = "#") -> Any:
    """``rewrite(subschema, path)`` applied to every subschema, children first."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {
                k: map_schema(v, rewrite, f"{path}/{key}/{k}") for k, v in node[key].items()
            }
    if isinstance(node.get("dependencies"), dict):
        out["dependencies"] = {
            k: map_schema(v, rewrite, f"{path}/dependencies/{k}") if isinstance(v, dict) else v
            for k, v in node["dependencies"].items()
        }
    for key in _ONE:
        if isinstance(node.get(key), dict):
            out[key] = map_schema(node[key], rewrite, f"{path}/{key}")
    for key in _MANY:
        if isinstance(node.get(key), list):
            out[key] = [
                map_schema(v, rewrite, f"{path}/{key}/{i}") for i, v in enumerate(node[key])
            ]
    return rewrite(out, path)


def closed_objects(schema: Any) -> Any:
    """Objects that do not say otherwise get ``additionalProperties: false``: the output holds the
    properties the schema names, as with xgrammar's strict mode and OpenAI's structured outputs."""

    def close(node: dict[str, Any], path: str) -> dict[str, Any]:
        if "properties" in node and "additionalProperties" not in node:
            return {**node, "additionalProperties": False}
        return node

    return map_schema(schema, close)
