"""KV connector ``none``: a single engine, no prefill/decode disaggregation."""

from __future__ import annotations

from typing import Any

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import KVConnector, TransferEvent

_OFF = (
    "KV transfer is off (kv_transfer=none); start with --disaggregation-mode prefill|decode "
    "and --disaggregation-transfer-backend tcp|mooncake|nixl"
)


class NoKVConnector(KVConnector):
    def start(self, role: str, kv_pool: Any, bootstrap_port: int, timeout: float) -> None:
        raise RuntimeError(_OFF)

    def send(self, room: int, kv_slots: Any, meta: bytes) -> None:
        raise RuntimeError(_OFF)

    def receive(self, room: int, peer: tuple[str, int], kv_slots: Any) -> None:
        raise RuntimeError(_OFF)

    def cancel(self, room: int, reason: str, refused: bool = False) -> None:
        pass

    def poll(self) -> list[TransferEvent]:
        return []


@hookimpl
def register_kv_connectors(register) -> None:  # type: ignore[no-untyped-def]
    register("none", NoKVConnector, description="disaggregation off")
