"""The Anthropic Messages API (/v1/messages) request, and its translation into a chat request.

A Messages request is served as the chat request it amounts to: the system prompt becomes a
system message, ``tool_use`` blocks an assistant turn's tool calls, ``tool_result`` blocks tool
messages, ``tools`` (``input_schema``) function tools, ``tool_choice`` auto / any / tool / none
the chat route's auto / required / named / none, ``stop_sequences`` stop strings. What the chat
route does with that (the template, the forcing grammar, the parsers) is then the same.
Content other than text, tool_use, tool_result and thinking (images, documents, server tools)
is refused with a 400 naming where it is. SGLang's extensions (``ChatExtensions``: regex,
ignore_eos, chat_template_kwargs, ...) are taken as the chat route takes them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from radixserve.entrypoints.agent_protocol import ChatExtensions, chat_body
from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; Anthropic's server tools are not served


class CountTokensRequest(ChatExtensions):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # the reasoning parser decides; accepted, unused


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None  # accepted and ignored


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request ``body`` amounts to (400 naming the field where it cannot be one)."""
    choice, parallel = _tool_choice(body.tool_choice)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.system, body.messages),
        "tools": [_tool(i, t) for i, t in enumerate(body.tools)] if body.tools else None,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        **body.extensions(),
    }
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences or None,
            stream=body.stream,
        )
    return chat_body(fields)


def chat_messages(
    system: str | list[dict[str, Any]] | None, messages: list[AnthropicMessage]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts, calls, results = [], [], []
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type")
            if kind == "text":
                texts.append(_text([block], where))
            elif kind == "tool_use" and message.role == "assistant":
                calls.append(_tool_use(block, where))
            elif kind == "tool_result" and message.role == "user":
                results.append(_tool_result(block, where))
            elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # earlier reasoning is not shown to the model again
            else:
                raise ApiError(
                    400,
                    f"{where} has type {kind!r}, which a {message.role} message cannot have "
                    "here; supported: text, tool_use (assistant), tool_result (user), thinking",
                    param=where,
                )
        out.extend(results)  # the answers to the previous turn's calls come first
        if texts or calls or not results:
            turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def _text(value: str | list[Any], where: str) -> str:
    """A string, or text blocks joined (any other block is a 400)."""
    if isinstance(value, str):
        return value
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ApiError(
                400, f"{where}[{j}] has type {kind!r}; only text blocks are supported", where
            )
        if not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}: a text block needs a 'text' string", param=where)
        texts.append(block["text"])
    return "\n".join(texts)


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, tool_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(tool_id, str) or not isinstance(args, dict):
        raise ApiError(
            400, f"{where}: a tool_use block needs 'id', 'name' and an 'input' object", where
        )
    function = {"name": name, "arguments": json.dumps(args)}
    return {"id": tool_id, "type": "function", "function": function}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    tool_id = block.get("tool_use_id")
    if not isinstance(tool_id, str):
        raise ApiError(400, f"{where}: a tool_result block needs 'tool_use_id'", param=where)
    content = block.get("content", "")
    if not isinstance(content, str | list):
        raise ApiError(
            400, f"{where}.content must be a string or text blocks", param=f"{where}.content"
        )
    text = _text(content, f"{where}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": tool_id, "content": text}


def _tool(index: int, tool: AnthropicTool) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise ApiError(
            400,
            f"tools[{index}] has type {tool.type!r}; only custom tools (with an input_schema) "
            "are served",
            param=f"tools[{index}].type",
        )
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool]:
    """(the chat route's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, True
    parallel = choice.get("disable_parallel_tool_use") is not True
    kind = choice.get("type")
    if isinstance(kind, str) and kind in _CHOICES:
        return _CHOICES[kind], parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ApiError(
        400,
        f"tool_choice must be {{'type': 'auto' | 'any' | 'none'}} or "
        f"{{'type': 'tool', 'name': ...}}, got {json.dumps(choice)[:200]}",
        param="tool_choice",
    )
