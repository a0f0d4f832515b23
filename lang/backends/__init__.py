"""Frontend backends: RuntimeEndpoint (native HTTP API), OpenAI (any OpenAI-compatible
server) and EngineBackend (an in-process Engine). Each is imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.lang.backends.base import Backend, BackendError, ProgramView

if TYPE_CHECKING:
    from radixserve.lang.backends.engine import EngineBackend
    from radixserve.lang.backends.openai import OpenAI
    from radixserve.lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "BackendError", "EngineBackend", "OpenAI", "ProgramView", "RuntimeEndpoint"]

_LAZY = {
    "RuntimeEndpoint": "radixserve.lang.backends.runtime_endpoint",
    "OpenAI": "radixserve.lang.backends.openai",
    "EngineBackend": "radixserve.lang.backends.engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
