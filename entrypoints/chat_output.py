"""How one chat request's output becomes an assistant message: the reasoning block split off
first (``--reasoning-parser``), then tool calls read from what remains (the request's
``ToolPlan``), whole or streamed."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.entrypoints.openai_protocol import ChatCompletionRequest, DeltaToolCall, ToolCall
from radixserve.entrypoints.reasoning import (
    REASONING_PARSERS,
    ReasoningSplit,
    split_reasoning,
)
from radixserve.entrypoints.tool_calls import ToolPlan


@dataclass(frozen=True)
class ChatOutput:
    plan: ToolPlan
    reasoning_parser: str | None  # the server's --reasoning-parser, if any
    body: ChatCompletionRequest

    @property
    def splits_reasoning(self) -> bool:
        # a JSON grammar (a forced tool_choice, response_format, json_schema) makes the whole
        # output JSON from the first token: no reasoning block to split off (a parser that
        # assumes one open would take the answer as reasoning). A regex or EBNF may spell one.
        if self.json_only:
            return False
        return self.reasoning_parser is not None and self.body.separate_reasoning

    @property
    def json_only(self) -> bool:
        fmt = self.body.response_format
        return (
            self.plan.forced_schema is not None
            or (fmt is not None and fmt.type != "text")
            or self.body.json_schema is not None
        )

    def _split(self) -> ReasoningSplit:
        assert self.reasoning_parser is not None
        fmt = REASONING_PARSERS[self.reasoning_parser]
        forced = fmt.forced(self.body.chat_template_kwargs)
        return ReasoningSplit(fmt, forced, self.body.stream_reasoning)

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning_content, content, tool_calls) of a finished output."""
        reasoning = None
        if self.splits_reasoning:
            split = self._split()
            reasoning, text = split_reasoning(split.fmt, split.forced, text)
        if self.plan.active:
            content, calls = self.plan.parse(text)
            return reasoning, content, calls
        return reasoning, (text or None) if reasoning is not None else text, []

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


class ChatOutputStream:
    """One choice's stream: (reasoning, content, tool call deltas) to send per update."""

    def __init__(self, output: ChatOutput) -> None:
        self.split = output._split() if output.splits_reasoning else None
        self.tools = output.plan.stream() if output.plan.active else None

    @property
    def calls_sent(self) -> int:
        return self.tools.calls_sent if self.tools is not None else 0

    def feed(self, delta: str, finished: bool) -> tuple[str, str, list[DeltaToolCall]]:
        reasoning, content = "", delta
        if self.split is not None:
            reasoning, content = self.split.feed(delta)
            if finished:
                more_reasoning, more_content = self.split.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[DeltaToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, finished)
        return reasoning, content, calls
