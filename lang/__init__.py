"""The frontend language: ``@function`` programs built from gen, select, role blocks and
fork/join, run on a RuntimeEndpoint, OpenAI or in-process Engine backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.lang.api import (
    Function,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    image,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixserve.lang.backends.base import Backend, BackendError
from radixserve.lang.chat_template import ChatTemplate, get_chat_template
from radixserve.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixserve.lang.state import ProgramState, ProgramStateGroup

if TYPE_CHECKING:
    from radixserve.lang.backends import EngineBackend, OpenAI, RuntimeEndpoint

__all__ = [
    "Backend",
    "BackendError",
    "ChatTemplate",
    "EngineBackend",
    "Function",
    "OpenAI",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_chat_template",
    "get_default_backend",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]

_BACKENDS = ("RuntimeEndpoint", "OpenAI", "EngineBackend")


def __getattr__(name: str) -> Any:
    # Backends import requests / openai / torch: only when asked for.
    if name in _BACKENDS:
        from radixserve.lang import backends

        return getattr(backends, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
