"""Tools on /v1/chat/completions: the prompt, the grammar that forces a call, and parsing the
model's calls out of its text (whole or streamed).

Parsers are pluggable by name (``TOOL_PARSERS``); the default, ``hermes``, reads the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks that Qwen, Hermes and the
SmolLM family are trained to write. With ``tool_choice`` "required" or a named function the
output is constrained to one call object (``{"name", "arguments"}``, JSON) by the grammar.
A block that is not valid JSON stays in the content: nothing is repaired.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest, FunctionCall, ToolCall

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>{tools}</tools>\nFor each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks; text outside them is the content."""

    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, calls): each call {"name": str, "arguments": dict}."""
        calls: list[dict[str, Any]] = []
        kept: list[str] = []
        last = 0
        for m in self._block.finditer(text):
            call = parse_call(m.group(1))
            if call is None:
                continue  # not a valid call: it stays in the content
            kept.append(text[last : m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        return "".join(kept).strip(), calls


TOOL_PARSERS: dict[str, type[HermesParser]] = {"hermes": HermesParser}


def parse_call(text: str) -> dict[str, Any] | None:
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return {"name": call["name"], "arguments": args} if isinstance(args, dict) else None


@dataclass
class ToolPlan:
    """How one chat request uses tools: what the template gets and how output is read."""

    tools: list[dict[str, Any]]  # OpenAI tool objects (empty: tools off)
    forced_schema: str | None = None  # JSON schema of the one call the output must be
    parser: HermesParser = field(default_factory=HermesParser)

    @property
    def active(self) -> bool:
        return bool(self.tools)

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
        if self.forced_schema is not None:
            call = parse_call(text)
            return (None, [_tool_call(call)]) if call else (text, [])
        content, calls = self.parser.parse(text)
        return content or None, [_tool_call(c) for c in calls]


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """Check ``tools`` and ``tool_choice``; 400 naming the bad field."""
    choice = body.tool_choice
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
        return ToolPlan(body.tools)
    if choice == "required":
        return ToolPlan(body.tools, _call_schema(body.tools))
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        name = choice["function"]["name"]
        chosen = [t for t in body.tools if t["function"]["name"] == name]
        if not chosen:
            raise ApiError(
                400, f"tool_choice names '{name}', which is not in tools ({', '.join(names)})",
                param="tool_choice",
            )  # fmt: skip
        return ToolPlan(body.tools, _call_schema(chosen))
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


def _tool_call(call: dict[str, Any]) -> ToolCall:
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=call["name"], arguments=json.dumps(call["arguments"])),
    )


class ToolStream:
    """Splits one streamed output into content deltas and completed tool calls.

    Content is streamed up to the first ``<tool_call>`` (a tail that might be the start of
    that tag is held back); calls are sent as each block closes; the rest of the content comes
    with the last update. A forced call is sent once the output is complete."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent_content = 0
        self.sent_calls = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content to send now, tool calls to send now) after ``delta`` more text."""
        self.text += delta
        if finished:
            content, calls = self.plan.parse(self.text)
            done = self.text[: self.sent_content].lstrip()
            content = content or ""
            rest = content[len(done) :] if content.startswith(done) else ""
            return rest, calls[self.sent_calls :]
        if self.plan.forced_schema is not None:
            return "", []
        start = self.plan.parser.start
        cut = self.text.find(start)
        if cut < 0:
            cut = len(self.text) - _partial_tag(self.text, start)
        content = self.text[self.sent_content : cut]
        self.sent_content = max(self.sent_content, cut)
        _, calls = self.plan.parse(self.text)
        new = calls[self.sent_calls :]
        self.sent_calls = len(calls)
        return content, new


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
