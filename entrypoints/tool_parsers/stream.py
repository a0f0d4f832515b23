"""Tool calls streamed as OpenAI streams them.

Content is sent until the first call starts (a partial marker at the end is held back, and
so is whitespace that the finished output would strip). Each call is sent once its name and
the start of its arguments have arrived: a delta with its index, id, type and name, then its
arguments as fragments while they grow. A call that cannot be read that way (another key
order) is sent whole when it completes. Content after the first call comes with the last
update. Fed any split of an output, the stream ends with the same content and calls as
``ToolParser.parse`` of the whole output, save for a call that turns out malformed after it
started (then the client has seen part of it; its text also comes as content).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from radixserve.core.stop import partial_marker
from radixserve.entrypoints.openai_protocol import DeltaToolCall, FunctionCall
from radixserve.entrypoints.tool_parsers.base import ToolParser, json_end


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class _Started:
    index: int  # OpenAI's tool call index
    args_sent: str = ""
    done: bool = False


@dataclass
class ToolStream:
    """One choice's stream. ``limit``: at most this many calls (parallel_tool_calls=false)."""

    parser: ToolParser
    limit: int | None = None
    text: str = ""
    content_sent: str = ""
    started: dict[int, _Started] = field(default_factory=dict)  # by call piece ordinal

    @property
    def calls_sent(self) -> int:
        return len(self.started)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content, tool call deltas) to send after ``delta`` more text."""
        self.text += delta
        pieces = self.parser.split(self.text)
        if finished:
            content, _ = self.parser.parse(self.text)
        else:
            lead = 0
            for piece in pieces:
                if piece.body is not None:
                    break
                lead += len(piece.raw)
            else:
                lead -= partial_marker(self.text, self.parser.markers)
            content = self.text[:lead].strip()
        new_content = ""
        if content.startswith(self.content_sent):
            new_content = content[len(self.content_sent) :]
            self.content_sent = content
        deltas: list[DeltaToolCall] = []
        calls = [p for p in pieces if p.body is not None]
        for ordinal, piece in enumerate(calls):
            assert piece.body is not None
            started = self.started.get(ordinal)
            if started is not None and started.done:
                continue
            if piece.closed:
                call = self.parser.call(piece.body)
                if started is None:
                    if call is not None and self._room():
                        index = self.calls_sent
                        self.started[ordinal] = _Started(index, call.arguments, done=True)
                        deltas.append(_delta(index, call.name, call.arguments))
                    continue
                if call is not None and call.arguments.startswith(started.args_sent):
                    rest = call.arguments[len(started.args_sent) :]
                    if rest:
                        deltas.append(_delta(started.index, None, rest))
                started.done = True
            elif not finished:
                head = self.parser.head(piece.body)
                if head is None:
                    continue
                end = json_end(piece.body, head.args_start) or len(piece.body)
                args = piece.body[head.args_start : end]
                if started is None:
                    if not self._room():
                        continue
                    started = self.started[ordinal] = _Started(self.calls_sent)
                    deltas.append(_delta(started.index, head.name, ""))
                if len(args) > len(started.args_sent):
                    deltas.append(_delta(started.index, None, args[len(started.args_sent) :]))
                    started.args_sent = args
        return new_content, _merge(deltas)

    def _room(self) -> bool:
        return self.limit is None or self.calls_sent < self.limit


def _delta(index: int, name: str | None, arguments: str) -> DeltaToolCall:
    if name is None:
        return DeltaToolCall(index=index, function=FunctionCall(arguments=arguments))
    function = FunctionCall(name=name, arguments=arguments)
    return DeltaToolCall(index=index, id=call_id(), type="function", function=function)


def _merge(deltas: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """One delta per call per update: a call's fragments sent together are joined."""
    out: list[DeltaToolCall] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            prev = out[-1]
            assert prev.function is not None and d.function is not None
            prev.function.arguments = (prev.function.arguments or "") + (d.function.arguments or "")
        else:
            out.append(d)
    return out
