"""The tool-call formats of the model families served (SGLang's parser names).

- ``hermes`` (also ``qwen25``, ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks, anywhere in the output (Qwen2.5/Qwen3, Hermes, SmolLM).
- ``llama3``: Llama 3.1/3.2 JSON calls, ``{"name": ..., "parameters": {...}}``, after an
  optional ``<|python_tag|>`` or as the whole output, several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS] [{...}, {...}]``, or the compact ``[TOOL_CALLS]name[ARGS]{...}``
  of newer Mistral templates (repeated for several calls).
- ``ForcedParser``: the bare call object a forced ``tool_choice`` constrains the output to.
"""

from __future__ import annotations

import re

from radixserve.entrypoints.tool_parsers.base import (
    Call,
    Head,
    Piece,
    ToolParser,
    json_end,
    loads_or_none,
    skip_space,
)


class HermesParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    markers = (start,)

    def split(self, text: str) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (s := text.find(self.start, pos)) >= 0:
            if s > pos:
                pieces.append(Piece(text[pos:s]))
            body_at = s + len(self.start)
            e = text.find(self.end, body_at)
            if e < 0:
                pieces.append(Piece(text[s:], text[body_at:], closed=False))
                return pieces
            pos = e + len(self.end)
            pieces.append(Piece(text[s:pos], text[body_at:e]))
        if pos < len(text):
            pieces.append(Piece(text[pos:]))
        return pieces


class Llama3Parser(ToolParser):
    name = "llama3"
    tag = "<|python_tag|>"
    markers = (tag,)
    keeps_special_tokens = True
    _separator = re.compile(r"\s*;?\s*")

    def split(self, text: str) -> list[Piece]:
        t = text.find(self.tag)
        if t >= 0:
            pieces, pos, lead = [Piece(text[:t])] if t else [], t + len(self.tag), self.tag
        elif text[skip_space(text, 0) : skip_space(text, 0) + 1] == "{":
            pieces, pos, lead = [], 0, ""  # the whole output is the calls
        else:
            return [Piece(text)] if text else []
        # Each object takes the separator before it (and the tag, the first one).
        while True:
            at = self._separator.match(text, pos).end()  # type: ignore[union-attr]
            if at == len(text) and lead:  # the tag, and no call yet
                pieces.append(Piece(lead + text[pos:], "", closed=False))
                return pieces
            if at == len(text) or text[at] != "{":
                if lead or pos < len(text):
                    pieces.append(Piece(lead + text[pos:]))
                return pieces
            end = json_end(text, at)
            if end is None:
                pieces.append(Piece(lead + text[pos:], text[at:], closed=False))
                return pieces
            pieces.append(Piece(lead + text[pos:end], text[at:end]))
            pos, lead = end, ""


class MistralParser(ToolParser):
    name = "mistral"
    mark = "[TOOL_CALLS]"
    markers = (mark,)
    keeps_special_tokens = True
    _compact = re.compile(r"\s*([^\s\[\]{}]+)\s*\[ARGS\]\s*(?=\{)")
    _element = re.compile(r"\s*,?\s*")

    def split(self, text: str) -> list[Piece]:
        t = text.find(self.mark)
        if t < 0:
            return [Piece(text)] if text else []
        pieces = [Piece(text[:t])] if t else []
        at = skip_space(text, t + len(self.mark))
        if at < len(text) and text[at] == "[" and not text.startswith("[ARGS]", at):
            self._split_array(text, t, at + 1, pieces)
        else:
            self._split_compact(text, t, pieces)
        return pieces

    def _split_array(self, text: str, pos: int, at: int, pieces: list[Piece]) -> None:
        lead_at = pos  # "[TOOL_CALLS] [" belongs to the first element
        while True:
            el = self._element.match(text, at).end()  # type: ignore[union-attr]
            if el < len(text) and text[el] == "]" and len(pieces) and pieces[-1].body:
                last = pieces[-1]  # the closing bracket belongs to the last element
                pieces[-1] = Piece(last.raw + text[at : el + 1], last.body, last.closed)
                lead_at = el + 1
                break
            if el == len(text) or text[el] != "{":
                break
            end = json_end(text, el)
            if end is None:
                pieces.append(Piece(text[lead_at:], text[el:], closed=False))
                return
            pieces.append(Piece(text[lead_at:end], text[el:end]))
            lead_at = at = end
        if lead_at < len(text):
            open_call = el == len(text) and lead_at == pos  # "[TOOL_CALLS] [" and no more yet
            pieces.append(Piece(text[lead_at:], "", False) if open_call else Piece(text[lead_at:]))

    def _split_compact(self, text: str, pos: int, pieces: list[Piece]) -> None:
        raw_at = pos  # whitespace between two calls belongs to the second
        while text.startswith(self.mark, pos):
            body_at = pos + len(self.mark)
            m = self._compact.match(text, body_at)
            end = json_end(text, m.end()) if m else None
            if end is None:
                pieces.append(Piece(text[raw_at:], text[body_at:], closed=False))
                return
            pieces.append(Piece(text[raw_at:end], text[body_at:end]))
            raw_at, pos = end, skip_space(text, end)
        if raw_at < len(text):
            pieces.append(Piece(text[raw_at:]))

    def head(self, body: str) -> Head | None:
        m = self._compact.match(body)
        return Head(m.group(1), m.end()) if m else super().head(body)

    def call(self, body: str) -> Call | None:
        m = self._compact.match(body)
        if m is None:
            return super().call(body)
        end = json_end(body, m.end())
        if end is None or body[end:].strip():
            return None
        args = loads_or_none(body[m.end() : end])
        return self._call(body, m.group(1), args if isinstance(args, dict) else None)


class ForcedParser(ToolParser):
    """The whole output is one call object (a grammar forced it): a call from the start."""

    name = "forced"

    def split(self, text: str) -> list[Piece]:
        at = skip_space(text, 0)
        closed = text[at : at + 1] == "{" and json_end(text, at) is not None
        return [Piece(text, text, closed)]
