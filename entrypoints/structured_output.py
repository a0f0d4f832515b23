"""OpenAI ``response_format`` (and forced tool calls) as the engine's grammar fields."""

from __future__ import annotations

import json
from typing import Any

from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest, ResponseFormat
from radixserve.entrypoints.tool_calls import ToolPlan


def response_format_schema(fmt: ResponseFormat | None) -> str | None:
    """The JSON schema ``response_format`` asks for, or None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    if fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(
                400,
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        return json.dumps(schema)
    raise ApiError(
        400,
        f"response_format type '{fmt.type}' is not supported; use text, json_object or json_schema",
        param="response_format",
    )


def chat_grammar(body: ChatCompletionRequest, plan: ToolPlan) -> dict[str, Any]:
    """Grammar fields for SamplingParams: from response_format or a forced tool call."""
    schema = response_format_schema(body.response_format)
    if plan.forced_schema is not None:
        if schema is not None:
            raise ApiError(
                400,
                "give either response_format or a forced tool_choice, not both",
                param="tool_choice",
            )
        schema = plan.forced_schema
    return {} if schema is None else {"json_schema": schema}
