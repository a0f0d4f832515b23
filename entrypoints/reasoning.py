"""Reasoning content (``--reasoning-parser``): a model's ``<think>...</think>`` block split out
of its output into ``reasoning_content``, whole or streamed, as SGLang's reasoning parsers do.

- ``deepseek-r1``: the chat template opens the block, so the output starts inside it (a
  leading ``<think>`` is dropped); everything up to ``</think>`` is reasoning.
- ``qwen3``: the same, unless the request sends ``chat_template_kwargs`` with
  ``enable_thinking: false`` (the template then closes an empty block in the prompt, and the
  output is reasoning only if it opens ``<think>`` itself). A ``<tool_call>`` also ends the
  reasoning (Qwen3 sometimes starts a call without closing the block).

An output cut short inside the block is all reasoning. The split is a small state machine
fed text in any pieces; the whole-output split is the same machine fed once, so a stream
always adds up to the whole response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.core.stop import partial_marker


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    interrupt: str | None = None  # also ends the reasoning, and starts the content
    toggle: str | None = None  # chat_template_kwargs key whose false turns thinking off

    def forced(self, template_kwargs: dict[str, Any] | None) -> bool:
        """Whether the output starts inside the block (the template opened it)."""
        return self.toggle is None or (template_kwargs or {}).get(self.toggle) is not False


REASONING_PARSERS = {
    "deepseek-r1": ReasoningFormat(),
    "qwen3": ReasoningFormat(interrupt="<tool_call>", toggle="enable_thinking"),
}


class ReasoningSplit:
    """One output's split. ``feed`` returns (reasoning, content) to send now; ``finish`` the
    rest. ``stream_reasoning`` false holds the reasoning back until the block ends."""

    def __init__(self, fmt: ReasoningFormat, forced: bool, stream_reasoning: bool = True) -> None:
        self.fmt = fmt
        self.forced = forced
        self.stream_reasoning = stream_reasoning
        self.state = "start"  # start -> reasoning -> content
        self.buffer = ""  # text not yet classified
        self.held = ""  # reasoning not yet sent (stream_reasoning false)

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        if self.state == "start" and not self._open():
            return "", ""
        if self.state == "reasoning":
            return self._reason()
        content, self.buffer = self.buffer, ""
        return "", content

    def finish(self) -> tuple[str, str]:
        if self.state == "start":  # too little to tell: forced means reasoning
            self.state = "reasoning" if self.forced else "content"
        reasoning, content = "", self.buffer
        if self.state == "reasoning":
            reasoning, content = self.held + self.buffer, ""
        self.buffer = self.held = ""
        return reasoning, content

    def _open(self) -> bool:
        """Decide, from the start of the output, whether it begins in a reasoning block;
        False while the text could still be the start of ``<think>``."""
        head = self.buffer.lstrip()
        if not head or (self.fmt.start.startswith(head) and head != self.fmt.start):
            return False
        if head.startswith(self.fmt.start):
            self.buffer = head[len(self.fmt.start) :]
            self.state = "reasoning"
        else:
            self.state = "reasoning" if self.forced else "content"
        return True

    def _reason(self) -> tuple[str, str]:
        fmt, text = self.fmt, self.buffer
        ends = [(text.find(fmt.end), len(fmt.end))]
        if fmt.interrupt:
            ends.append((text.find(fmt.interrupt), 0))  # the interrupting tag is content
        found = [(at, skip) for at, skip in ends if at >= 0]
        if found:
            at, skip = min(found)
            self.state, self.buffer = "content", ""
            reasoning, self.held = self.held + text[:at], ""
            return reasoning, text[at + skip :]
        markers = (fmt.end, fmt.interrupt) if fmt.interrupt else (fmt.end,)
        cut = len(text) - partial_marker(text, markers)
        self.buffer = text[cut:]
        if not self.stream_reasoning:
            self.held += text[:cut]
            return "", ""
        return text[:cut], ""


def split_reasoning(fmt: ReasoningFormat, forced: bool, text: str) -> tuple[str | None, str]:
    """(reasoning or None when there is none, content) of a finished output."""
    split = ReasoningSplit(fmt, forced)
    r1, c1 = split.feed(text)
    r2, c2 = split.finish()
    return (r1 + r2) or None, c1 + c2
