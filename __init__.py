"""radixserve: an LLM serving engine with a radix-tree KV prefix cache, built as a minimal core
with pluggy plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.core.hookspecs import hookimpl
from radixserve.core.request import SamplingParams

if TYPE_CHECKING:
    from radixserve.entrypoints.engine import Engine

__all__ = ["Engine", "SamplingParams", "hookimpl"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Engine pulls in torch; keep `import radixserve` (and `radixserve plugins`) light.
    if name == "Engine":
        from radixserve.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
