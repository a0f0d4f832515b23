"""KV connector ``mooncake``: the prefill writes KV straight into the decode's KV pool with
Mooncake's TransferEngine (RDMA, or its TCP transport: ``RADIXSERVE_MOONCAKE_PROTOCOL``,
default ``tcp``; CPU machines use the ``mooncake-transfer-engine-non-cuda`` wheel).

Control channel, staging and write layout: ``remote_write.py``. The decode registers its pool's
per-layer buffers with its TransferEngine at start and names its session in each ``Want``; the
prefill registers a room's staged KV, writes it with one batched call and unregisters it. The
decode's pool must be memory the wheel can register (host memory for the non-CUDA wheel).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import logging
import os
import threading
from typing import Any

from radixserve.core.hookspecs import hookimpl
from radixserve.core.memory import KVPool
from radixserve.plugins.kv_transfer.remote_write import (
    RemoteWriteConnector,
    Writes,
    WriteTarget,
    local_address,
)

logger = logging.getLogger(__name__)

PROTOCOL_ENV = "RADIXSERVE_MOONCAKE_PROTOCOL"  # tcp (default) or rdma
HOST_ENV = "RADIXSERVE_MOONCAKE_HOST"  # the address peers reach this engine at
DEVICE_ENV = "RADIXSERVE_MOONCAKE_DEVICE"  # RDMA device names, e.g. mlx5_0 (rdma only)


class MooncakeKVConnector(RemoteWriteConnector):
    def __init__(self) -> None:
        super().__init__()
        self.engine: Any = None
        self.session = ""
        self._register = threading.Lock()  # (un)registrations from several connections

    def start(self, role: str, kv_pool: KVPool, bootstrap_port: int, timeout: float) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # the registry said why; say it again, with the cause
            raise RuntimeError(f"kv_transfer 'mooncake' cannot load Mooncake: {e}") from e

        super().start(role, kv_pool, bootstrap_port, timeout)
        host = os.environ.get(HOST_ENV) or local_address()
        protocol = os.environ.get(PROTOCOL_ENV, "tcp")
        engine = TransferEngine()
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, os.environ.get(DEVICE_ENV, ""))
        if rc != 0:
            raise RuntimeError(f"Mooncake's TransferEngine did not start on {host}: {rc}")
        if role == "decode":
            for t in self.pool_buffers():
                if engine.register_memory(t.data_ptr(), t.nbytes) != 0:
                    raise RuntimeError(
                        f"Mooncake cannot register the KV pool's {t.device} memory (the "
                        "non-CUDA wheel registers host memory only)"
                    )
        self.engine = engine
        self.session = f"{host}:{engine.get_rpc_port()}"
        logger.info("Mooncake TransferEngine %s (%s), %s side", self.session, protocol, role)

    def agent(self) -> tuple[str, bytes]:
        return self.session, b""

    def write(self, target: WriteTarget, writes: Writes) -> str | None:
        engine = self.engine
        with self._register:
            if engine.register_memory(writes.src_base, writes.src_nbytes) != 0:
                return "Mooncake cannot register the staged KV"
        try:
            rc = engine.batch_transfer_sync_write(
                target.agent, writes.srcs, writes.dsts, writes.lens
            )
        finally:
            with self._register:
                engine.unregister_memory(writes.src_base)
        return None if rc == 0 else f"the Mooncake write to {target.agent} failed ({rc})"


def _available() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return (
            "the Mooncake package is not installed (pip install mooncake-transfer-engine, or "
            "mooncake-transfer-engine-non-cuda on CPU machines)"
        )
    for lib in ("ibverbs", "rdmacm"):
        if ctypes.util.find_library(lib) is None:
            return f"Mooncake needs lib{lib} (Debian: apt-get install libibverbs1 librdmacm1)"
    return None


@hookimpl
def register_kv_connectors(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "mooncake",
        MooncakeKVConnector,
        available=_available,
        description="Mooncake TransferEngine writes KV into the decode's pool (RDMA or TCP)",
    )
