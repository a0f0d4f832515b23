"""KV connector ``none``: a single engine, no prefill/decode disaggregation."""

from __future__ import annotations

from typing import Any

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import KVConnector
from radixserve.core.memory import KVPool


class NoKVConnector(KVConnector):
    def register_buffers(self, kv_pool: KVPool) -> None:
        pass

    def send(self, request_id: str, kv_indices: Any, peer: str) -> None:
        raise RuntimeError("KV transfer is off (kv_transfer=none); choose a connector plugin")

    def receive(self, request_id: str, kv_indices: Any) -> bool:
        raise RuntimeError("KV transfer is off (kv_transfer=none); choose a connector plugin")


@hookimpl
def register_kv_connectors(register) -> None:  # type: ignore[no-untyped-def]
    register("none", NoKVConnector, description="disaggregation off")
