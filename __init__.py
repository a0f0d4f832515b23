"""radixserve: an LLM serving engine with a radix-tree KV prefix cache, built as a minimal core
with pluggy plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.core.hookspecs import hookimpl
from radixserve.core.request import SamplingParams

if TYPE_CHECKING:
    from radixserve.entrypoints.engine import Engine
    from radixserve.lang import (
        EngineBackend,
        OpenAI,
        RuntimeEndpoint,
        assistant,
        assistant_begin,
        assistant_end,
        function,
        gen,
        gen_int,
        gen_string,
        select,
        set_default_backend,
        system,
        system_begin,
        system_end,
        user,
        user_begin,
        user_end,
    )

__all__ = [
    "Engine",
    "SamplingParams",
    "hookimpl",
    # the frontend language (radixserve.lang), imported on first use
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "set_default_backend",
    "system",
    "user",
    "assistant",
    "system_begin",
    "system_end",
    "user_begin",
    "user_end",
    "assistant_begin",
    "assistant_end",
    "RuntimeEndpoint",
    "OpenAI",
    "EngineBackend",
]
_FRONTEND = frozenset(__all__[3:])
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Engine pulls in torch; keep `import radixserve` (and `radixserve plugins`) light.
    if name == "Engine":
        from radixserve.entrypoints.engine import Engine

        return Engine
    if name in _FRONTEND:
        import radixserve.lang

        return getattr(radixserve.lang, name)
    raise AttributeError(name)
