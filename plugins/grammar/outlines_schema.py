"""What outlines-core can enforce of a JSON schema: numeric bounds are ignored by its converter,
so a small bounded integer range becomes an enum and any other bound is refused."""

from __future__ import annotations

import json
from typing import Any

from radixserve.plugins.grammar.schema_walk import map_schema

MAX_ENUM_RANGE = 1000
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_UNENFORCED = (
    "multipleOf", "uniqueItems", "patternProperties", "not", "if", "contains", "minProperties",
    "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
)  # fmt: skip


def enforceable_schema(spec: str) -> Any:
    """``spec`` parsed, bounded integers rewritten; ValueError naming what cannot be enforced."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from e
    return map_schema(schema, _enforceable)


def _enforceable(node: dict[str, Any], path: str) -> dict[str, Any]:
    for key in _UNENFORCED:
        if key in node:
            raise ValueError(f"'{key}' at {path} is not supported by the outlines backend")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise ValueError(f"'allOf' of several schemas at {path} is not supported by outlines")
    if not any(k in node for k in _BOUNDS):
        return node
    lo, hi = node.get("minimum"), node.get("maximum")
    lo = _exclusive(node.get("exclusiveMinimum"), lo, +1)
    hi = _exclusive(node.get("exclusiveMaximum"), hi, -1)
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi))
    if node.get("type") != "integer" or not ints or hi - lo >= MAX_ENUM_RANGE:
        raise ValueError(
            f"the outlines backend cannot enforce numeric bounds at {path} (only integer "
            f"ranges under {MAX_ENUM_RANGE} values); use --plugin grammar=xgrammar or llguidance"
        )
    rest = {k: v for k, v in node.items() if k not in (*_BOUNDS, "type")}
    return {**rest, "enum": list(range(lo, hi + 1))}


def _exclusive(flag: Any, bound: Any, step: int) -> Any:
    """The inclusive integer bound given an exclusive one: a number (draft 6 on) is itself the
    excluded bound; draft 4's boolean makes ``minimum``/``maximum`` exclusive."""
    if flag is None or flag is False:
        return bound
    if flag is True:
        return None if bound is None else bound + step
    return flag + step
