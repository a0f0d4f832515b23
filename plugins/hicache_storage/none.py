"""HiCache storage ``none``: no third tier (host eviction drops prefixes)."""

from __future__ import annotations

from typing import Any

from radixserve.core.hookspecs import hookimpl


def _none(extra_config: dict[str, Any]) -> None:
    return None


@hookimpl
def register_hicache_storage_backends(register) -> None:  # type: ignore[no-untyped-def]
    register("none", _none, description="no storage tier behind the host pool")
