"""Tools on /v1/chat/completions: the prompt, the grammar that forces a call, and which parser
reads the model's calls out of its text (``tool_parsers``, chosen with --tool-call-parser).

Without a template that renders ``tools`` itself, the prompt is the Hermes one, asking for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (what the default parser,
``hermes``, reads). With ``tool_choice`` "required" or a named function the output is
constrained to one call object (``{"name", "arguments"}``, JSON) by the grammar.
A call that is not valid JSON stays in the content: nothing is repaired. With
``parallel_tool_calls`` false only the first call is returned, as SGLang does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest, FunctionCall, ToolCall
from radixserve.entrypoints.tool_parsers import (
    ForcedParser,
    HermesParser,
    ToolParser,
    ToolStream,
    call_id,
)

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>{tools}</tools>\nFor each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass
class ToolPlan:
    """How one chat request uses tools: what the template gets and how output is read."""

    tools: list[dict[str, Any]]  # OpenAI tool objects (empty: tools off)
    forced_schema: str | None = None  # JSON schema of the one call the output must be
    parser: ToolParser = field(default_factory=HermesParser)
    limit: int | None = None  # most calls returned (1: parallel_tool_calls=false)

    @property
    def active(self) -> bool:
        return bool(self.tools)

    @property
    def reader(self) -> ToolParser:
        """The parser of this request's output: a forced call is the whole output."""
        return ForcedParser() if self.forced_schema is not None else self.parser

    def prompt_messages(
        self, messages: list[dict[str, Any]], template: str
    ) -> list[dict[str, Any]]:
        """Messages for the chat template: a Hermes tool prompt when the template itself does
        not render ``tools``."""
        if "tool_calls" not in template:
            messages = [_with_call_text(m) for m in messages]
        if not self.active or "tools" in template:
            return messages
        specs = json.dumps([t["function"] for t in self.tools])
        system = HERMES_SYSTEM.format(tools=specs)
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": messages[0]["content"] + "\n\n" + system}
            return [first, *messages[1:]]
        return [{"role": "system", "content": system}, *messages]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, tool calls) of a finished output."""
        content, calls = self.reader.parse(text)
        calls = calls[: self.limit]
        tool_calls = [
            ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ]
        return content or None, tool_calls

    def stream(self) -> ToolStream:
        """A stream reader for one choice of this request."""
        return ToolStream(self.reader, self.limit)


def plan_tools(body: ChatCompletionRequest, parser: ToolParser | None = None) -> ToolPlan:
    """Check ``tools`` and ``tool_choice``; 400 naming the bad field. ``parser``: the
    server's (--tool-call-parser); default Hermes."""
    choice = body.tool_choice
    read = {"parser": parser or HermesParser(), "limit": None if body.parallel_tool_calls else 1}
    if not body.tools or choice == "none":
        return ToolPlan([])
    names = []
    for i, tool in enumerate(body.tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(
                400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param=f"tools[{i}]",
            )  # fmt: skip
        names.append(fn["name"])
    if choice in (None, "auto"):
        return ToolPlan(body.tools, **read)
    if choice == "required":
        return ToolPlan(body.tools, _call_schema(body.tools), **read)
    named = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(named, dict) and isinstance(named.get("name"), str):
        name = named["name"]
        chosen = [t for t in body.tools if t["function"]["name"] == name]
        if not chosen:
            raise ApiError(
                400, f"tool_choice names '{name}', which is not in tools ({', '.join(names)})",
                param="tool_choice",
            )  # fmt: skip
        return ToolPlan(body.tools, _call_schema(chosen), **read)
    raise ApiError(
        400,
        f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
        param="tool_choice",
    )


def _call_schema(tools: list[dict[str, Any]]) -> str:
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
            }
        )
    return json.dumps(options[0] if len(options) == 1 else {"anyOf": options})


def _with_call_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's earlier calls as the Hermes text the model wrote."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ApiError(
                400,
                f"tool_calls[{i}] must be an object with a 'function' object, got "
                f"{json.dumps(call, default=str)[:100]}",
                param="messages",
            )
        args = fn.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            raise ApiError(400, f"tool_calls arguments are not JSON: {e}", param="messages") from e
        blocks.append(f"<tool_call>\n{json.dumps({'name': fn.get('name'), 'arguments': args})}")
    text = "\n</tool_call>\n".join(blocks) + "\n</tool_call>"
    content = message.get("content") or ""
    return {**message, "content": f"{content}\n{text}" if content else text}
