"""A chat output as a sequence of typed blocks: reasoning, text and tool calls, in the order the
model wrote them. /v1/messages (content blocks) and /v1/responses (output items) both present
an answer this way, whole or streamed; the chat route's parsing (``ChatOutput``: the reasoning
split, then the tool-call parser) decides what is what, here it is only put in order.

Streamed, ``BlockSequence.feed`` takes what one update of a ``ChatOutputStream`` gave and
returns the block events to send (a block starts, grows, stops); one block is open at a time,
and text of another kind closes it. The blocks a stream ends with are those of the whole
output (``whole_blocks``), as the chat route's stream adds up to its whole answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from radixserve.entrypoints.chat_output import ChatOutput
from radixserve.entrypoints.openai_protocol import DeltaToolCall
from radixserve.entrypoints.tool_parsers import call_id

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass(slots=True)
class Block:
    kind: BlockKind
    index: int  # position in the answer
    text: str = ""  # reasoning or text; a tool call's arguments (JSON text)
    call_id: str = ""  # tool calls: the id the client answers with its result
    name: str = ""  # tool calls: the function's name
    call_index: int = -1  # tool calls: the chat stream's index of the call

    def arguments(self) -> dict[str, Any]:
        """A tool call's arguments as an object (what /v1/messages' ``input`` holds)."""
        try:
            value = json.loads(self.text or "{}")
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {"value": value}


@dataclass(slots=True)
class BlockEvent:
    type: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""  # with "delta": the text added to the block


def whole_blocks(output: ChatOutput, text: str) -> list[Block]:
    """The blocks of a finished output."""
    reasoning, content, calls = output.parse(text)
    blocks: list[Block] = []
    if reasoning:
        blocks.append(Block("reasoning", 0, reasoning))
    if content:
        blocks.append(Block("text", len(blocks), content))
    for call in calls:
        fn = call.function
        blocks.append(
            Block("tool_call", len(blocks), fn.arguments or "", call.id, fn.name or "", len(blocks))
        )
    return blocks


class BlockSequence:
    """One streamed answer's blocks; ``blocks`` holds them all, as sent so far."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.open: Block | None = None

    @property
    def called(self) -> bool:
        return any(b.kind == "tool_call" for b in self.blocks)

    def feed(self, reasoning: str, text: str, calls: list[DeltaToolCall]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if reasoning:
            events += self._grow("reasoning", reasoning)
        if text:
            events += self._grow("text", text)
        for call in calls:
            events += self._call(call)
        return events

    def close(self) -> list[BlockEvent]:
        """The open block's stop event (at the end of the answer)."""
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [BlockEvent("stop", block)]

    def _grow(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        events = []
        if self.open is None or self.open.kind != kind:
            events += self.close()
            events.append(self._start(Block(kind, len(self.blocks))))
        assert self.open is not None
        self.open.text += text
        events.append(BlockEvent("delta", self.open, text))
        return events

    def _call(self, call: DeltaToolCall) -> list[BlockEvent]:
        fn = call.function
        args = (fn.arguments or "") if fn is not None else ""
        events = []
        block = next((b for b in self.blocks if b.call_index == call.index), None)
        if block is None:
            events += self.close()
            name = (fn.name or "") if fn is not None else ""
            new = Block("tool_call", len(self.blocks), "", call.id or call_id(), name, call.index)
            events.append(self._start(new))
            block = new
        if args:
            block.text += args
            events.append(BlockEvent("delta", block, args))
        return events

    def _start(self, block: Block) -> BlockEvent:
        self.blocks.append(block)
        self.open = block
        return BlockEvent("start", block)
