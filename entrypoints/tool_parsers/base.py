"""What every tool-call format shares.

A format's parser cuts an output (finished or still growing) into ``Piece``s whose ``raw``
texts concatenate to the output: plain text, or one call's text with its ``body`` (the call
itself, without the format's tags). Everything else is generic: the whole-output parse here,
and the streaming deltas in ``stream.py``, read the same pieces, so a streamed output ends
with the same content and calls as the whole one.

A call's ``arguments`` is the model's own JSON text of the arguments object when the call is
written name first (``{"name": ..., "arguments": {...}}``), which is what streaming can send
fragment by fragment; otherwise (another key order) it is the object re-encoded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple


@dataclass(frozen=True, slots=True)
class Piece:
    raw: str  # the exact output text of this piece
    body: str | None = None  # a call's own text; None: plain text
    closed: bool = True  # a call whose text is complete (only the last piece can be open)


class Call(NamedTuple):
    name: str
    arguments: str  # JSON text of an object


class Head(NamedTuple):
    """What streaming needs to start a call: its name, and where its arguments begin."""

    name: str
    args_start: int  # offset in the body of the arguments object's "{"


# A call object written name first, up to the "{" of its arguments (which must have arrived,
# so trailing whitespace is never half-read).
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)',
    re.DOTALL,
)
# JSON structure outside strings; an unterminated string has no closing quote (group q empty).
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(?P<q>"?)|[{}\[\]]', re.DOTALL)
_SPACE = re.compile(r"\s*")


def json_end(text: str, start: int) -> int | None:
    """Offset just past the JSON object or array that opens at ``text[start]``, or None while
    it is unfinished. Strings and escapes are respected; validity is not checked."""
    depth = 0
    for m in _JSON_TOKEN.finditer(text, start):
        token = m.group()
        if token[0] == '"':
            if not m.group("q"):
                return None  # the text ends inside a string
        elif token in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return m.end()
    return None


def skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]


class ToolParser:
    """One model family's tool-call format. Subclasses set ``name`` and ``markers`` and write
    ``split``; the JSON-object call form is read here."""

    name: ClassVar[str]
    # Texts that open the tool-call part of an output: streamed content stops at the first,
    # and a partial one at the end of the output is held back.
    markers: ClassVar[tuple[str, ...]] = ()
    # The markers are special tokens, so the output is detokenized with them (SGLang does
    # the same when tools are active).
    keeps_special_tokens: ClassVar[bool] = False

    def split(self, text: str) -> list[Piece]:
        """Cut ``text`` into pieces whose raws concatenate to it."""
        raise NotImplementedError

    def head(self, body: str) -> Head | None:
        """The call's name and where its arguments start, once both have arrived."""
        m = _HEAD.match(body)
        if m is None:
            return None
        name = loads_or_none(f'"{m.group(1)}"')
        return Head(name, m.end()) if isinstance(name, str) else None

    def call(self, body: str) -> Call | None:
        """The call a complete body holds, or None when it is not a valid call (its text then
        stays in the content)."""
        obj = loads_or_none(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return self._call(body, obj["name"], _as_object(args))

    def _call(self, body: str, name: str, args: dict[str, Any] | None) -> Call | None:
        if args is None:
            return None
        head = self.head(body)
        if head is not None and head.name == name:
            end = json_end(body, head.args_start)
            if end is not None and loads_or_none(body[head.args_start : end]) == args:
                return Call(name, body[head.args_start : end])
        return Call(name, json.dumps(args, ensure_ascii=False))

    def parse(self, text: str) -> tuple[str, list[Call]]:
        """(content, calls) of a finished output: text outside valid calls, stripped."""
        content: list[str] = []
        calls: list[Call] = []
        for piece in self.split(text):
            call = self.call(piece.body) if piece.body is not None and piece.closed else None
            if call is None:
                content.append(piece.raw)
            else:
                calls.append(call)
        return "".join(content).strip(), calls


def _as_object(args: Any) -> dict[str, Any] | None:
    # Some models write the arguments as a JSON string holding the object.
    if isinstance(args, str):
        args = loads_or_none(args)
    return args if isinstance(args, dict) else None


def loads_or_none(text: str) -> Any:
    """The JSON value of ``text``, or None when it is not JSON (or nests too deep to read)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
