"""The backend contract: what the interpreter asks of a model server.

The interpreter hands a backend a ``ProgramView`` (the program's text, its finished chat
messages and the open role, if any) rather than itself, so backends never touch interpreter
state. Methods are called from the program's worker thread; several programs (forks, batches)
call one backend concurrently, so implementations must be thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixserve.lang.chat_template import ChatTemplate, get_chat_template
from radixserve.lang.choices import ChoicesDecision, ChoicesMethod
from radixserve.lang.sampling import SamplingOptions

# Output-side meta_info lists that a stream delivers piece by piece: each streamed piece's
# meta_info holds only that piece's own entries (SGLang's frontend contract).
STREAM_DELTA_KEYS = ("output_token_logprobs", "output_top_logprobs")


class BackendError(RuntimeError):
    """A backend could not do what a program asked (unreachable, refused, unsupported)."""


@dataclass(frozen=True)
class ProgramView:
    text: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    role: str | None = None  # the open role block, if any
    role_text: str = ""  # what the open role block holds so far
    images: tuple[str, ...] = ()  # image(path) arguments so far, in prompt order


class Backend(ABC):
    chat_template: ChatTemplate = get_chat_template("default")

    def cache_prefix(self, text: str) -> None:
        """Make the backend's prefix cache hold ``text`` (no generation). Default: nothing."""

    @abstractmethod
    def generate(self, view: ProgramView, options: SamplingOptions) -> tuple[str, dict[str, Any]]:
        """Continue ``view``; return the completion only (not the prompt) and its meta_info."""

    def generate_stream(
        self, view: ProgramView, options: SamplingOptions
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield (new text, meta_info) pieces whose concatenation is the completion."""
        yield self.generate(view, options)

    @abstractmethod
    def select(
        self, view: ProgramView, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        """Score each choice as a continuation of ``view`` and pick one with ``method``."""

    def get_model_name(self) -> str:
        return type(self).__name__

    def shutdown(self) -> None:
        """Release what the backend holds (connections, an in-process engine)."""
