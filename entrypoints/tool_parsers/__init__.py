"""Tool-call parsers by name (``--tool-call-parser``, SGLang's names): each reads one model
family's format out of an output, whole (``parse``) or streamed (``ToolStream``)."""

from __future__ import annotations

from radixserve.entrypoints.tool_parsers.base import Call, Piece, ToolParser
from radixserve.entrypoints.tool_parsers.formats import (
    ForcedParser,
    HermesParser,
    Llama3Parser,
    MistralParser,
)
from radixserve.entrypoints.tool_parsers.stream import ToolStream, call_id

__all__ = [
    "DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "Call", "ForcedParser", "Piece", "ToolParser",
    "ToolStream", "call_id", "get_tool_parser",
]  # fmt: skip

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,  # Qwen2.5/Qwen3 write Hermes blocks
    "qwen": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}
# Without --tool-call-parser: the Hermes blocks the built-in tool prompt asks for.
DEFAULT_TOOL_PARSER = "hermes"


def get_tool_parser(name: str | None) -> ToolParser:
    """The parser named ``name`` (None: the default); ValueError naming the known ones."""
    cls = TOOL_PARSERS.get(name or DEFAULT_TOOL_PARSER)
    if cls is None:
        raise ValueError(
            f"unknown tool call parser '{name}'; available: {', '.join(sorted(TOOL_PARSERS))}"
        )
    return cls()
