"""The OpenAI Responses API (/v1/responses) request, and its translation into a chat request.

``input`` (a string, or items: messages with input_text / output_text parts, function_call and
function_call_output items; reasoning items are skipped) becomes chat messages, ``instructions``
a system message before them, function ``tools`` chat tools, ``tool_choice`` the chat route's,
``max_output_tokens`` its budget and ``text.format`` its response_format. With
``previous_response_id`` the stored conversation of that response goes before the new input
(``responses_store``); its instructions do not carry over, as OpenAI documents. SGLang's
extensions (``ChatExtensions``) are taken as the chat route takes them.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from radixserve.entrypoints.agent_protocol import ChatExtensions, chat_body
from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest


class ResponsesRequest(ChatExtensions):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # the reasoning parser decides; accepted, unused


def chat_request(
    body: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request for ``body`` whose conversation (the earlier turns and ``input``, as
    chat messages) is ``conversation``."""
    messages = list(conversation)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "tools": [_tool(i, t) for i, t in enumerate(body.tools)] if body.tools else None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        **body.extensions(),
    }
    return chat_body(fields)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (400 naming the item that cannot be one)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # one turn's calls together
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_call_output(item, where))
        elif kind != "reasoning":  # earlier reasoning is not shown to the model again
            raise ApiError(
                400,
                f"{where} has type {kind!r}; supported: message, function_call, "
                "function_call_output, reasoning",
                param=where,
            )
    return out


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    role = _ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise ApiError(
            400,
            f"{where}.role must be user, assistant, system or developer, got {item.get('role')!r}",
            param=f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of parts", f"{where}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"{where}.content[{j}] has type {kind!r}; only input_text and output_text "
                "parts (with a 'text' string) are supported",
                param=f"{where}.content[{j}]",
            )
        texts.append(part["text"])
    return {"role": role, "content": "\n".join(texts)}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
        raise ApiError(
            400,
            f"{where}: a function_call item needs 'call_id', 'name' and 'arguments' strings",
            param=where,
        )
    try:
        json.loads(args)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"{where}.arguments is not JSON: {e}", param=where) from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if isinstance(output, list):  # input_text parts
        output = _message({"role": "user", "content": output}, where)["content"]
    if not isinstance(call_id, str) or not isinstance(output, str):
        raise ApiError(
            400,
            f"{where}: a function_call_output item needs 'call_id' and an 'output' string",
            param=where,
        )
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise ApiError(
            400,
            f"tools[{index}] must be a function tool {{'type': 'function', 'name': ..., "
            f"'parameters': ...}}; got type {tool.get('type')!r}",
            param=f"tools[{index}]",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k)}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none" / "auto" / "required"; the chat route names any other value


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name", "output"), "schema": fmt.get("schema") or {}}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}
