"""KV connector ``mooncake``: the prefill writes KV straight into the decode's KV pool with
Mooncake's TransferEngine (RDMA, or its TCP transport: ``RADIXSERVE_MOONCAKE_PROTOCOL``,
default ``tcp``; CPU machines use the ``mooncake-transfer-engine-non-cuda`` wheel).

The control channel is the ``tcp`` connector's (the bootstrap server, one framed connection
per room, ``Want`` / ``Data`` / ``Gone``), with one difference: the decode's ``Want`` carries a
``MooncakeTarget`` (its TransferEngine session and the addresses of its pool's per-layer
buffers, registered with the engine at start, plus the room's slots), and the prefill, instead
of streaming bytes, writes each run of consecutive slots of each layer's K and V with one
batched TransferEngine write, then sends a ``Data`` frame of 0 bytes carrying the metadata.

The prefill stages the prompt's KV in host memory when the engine hands it over (``send``
must leave the slots free for reuse), registers that buffer for the write and unregisters it
after. The decode's pool must be memory the wheel can register (host memory for the non-CUDA
wheel; a CUDA wheel for device pools).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import logging
import os
import socket
from typing import Any

import msgspec
import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.core.memory import KVPool
from radixserve.plugins.kv_transfer.tcp import (
    Data,
    Gone,
    PeerError,
    TcpKVConnector,
    Want,
    write_frame,
)

logger = logging.getLogger(__name__)

PROTOCOL_ENV = "RADIXSERVE_MOONCAKE_PROTOCOL"  # tcp (default) or rdma
HOST_ENV = "RADIXSERVE_MOONCAKE_HOST"  # the address peers reach this engine at
DEVICE_ENV = "RADIXSERVE_MOONCAKE_DEVICE"  # RDMA device names, e.g. mlx5_0 (rdma only)


class MooncakeTarget(msgspec.Struct, kw_only=True):
    """Where a decode wants a room's KV written."""

    session: str  # host:rpc_port of the decode's TransferEngine
    buffers: list[int]  # base address of K then V of each layer
    row_bytes: int  # bytes of one token's K (or V) in one layer
    slots: list[int]


_target = msgspec.msgpack.Decoder(MooncakeTarget)


class MooncakeKVConnector(TcpKVConnector):
    def __init__(self) -> None:
        super().__init__()
        self.engine: Any = None
        self.session = ""

    def start(self, role: str, kv_pool: KVPool, bootstrap_port: int, timeout: float) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # the registry said why; say it again, with the cause
            raise RuntimeError(f"kv_transfer 'mooncake' cannot load Mooncake: {e}") from e

        super().start(role, kv_pool, bootstrap_port, timeout)
        host = os.environ.get(HOST_ENV) or _local_address()
        protocol = os.environ.get(PROTOCOL_ENV, "tcp")
        engine = TransferEngine()
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, os.environ.get(DEVICE_ENV, ""))
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine failed to start on {host} ({protocol}): {rc}"
            )
        if role == "decode":
            for t in self._buffers():
                if engine.register_memory(t.data_ptr(), t.nbytes) != 0:
                    raise RuntimeError(
                        f"Mooncake cannot register the KV pool's {t.device} memory; the "
                        "non-CUDA wheel registers host memory only"
                    )
        self.engine = engine
        self.session = f"{host}:{engine.get_rpc_port()}"
        logger.info("Mooncake TransferEngine %s (%s) for the %s side", self.session, protocol, role)

    def _buffers(self) -> list[torch.Tensor]:
        pool = self.pool
        assert pool is not None
        return [t for layer in range(len(pool.k)) for t in (pool.k[layer], pool.v[layer])]

    # -- decode: say where the KV goes; it is in the slots once the data frame comes ----------

    def want_target(self, slots: torch.Tensor) -> bytes:
        buffers = self._buffers()
        row = buffers[0].shape[1] * buffers[0].shape[2] * buffers[0].element_size()
        target = MooncakeTarget(
            session=self.session,
            buffers=[t.data_ptr() for t in buffers],
            row_bytes=row,
            slots=slots.tolist(),
        )
        return msgspec.msgpack.encode(target)

    def receive_payload(self, conn: socket.socket, frame: Data, slots: torch.Tensor) -> None:
        if frame.nbytes != 0:
            raise PeerError("the prefill streamed KV bytes; is it running the tcp connector?")
        return None

    # -- prefill: one batched write of the staged KV into the decode's pool ---------------------

    def send_data(self, conn: socket.socket, want: Want, ready: Any) -> None:
        try:
            target = _target.decode(want.target)
        except msgspec.DecodeError as e:
            write_frame(conn, Gone(room=want.room, message=f"no Mooncake target: {e}"))
            return
        payload = ready.payload  # uint8 [2 * layers, tokens, row bytes], contiguous host memory
        parts, n, row = payload.shape[0], payload.shape[1], payload[0, 0].nbytes
        if row != target.row_bytes or parts != len(target.buffers) or n != len(target.slots):
            write_frame(conn, Gone(room=want.room, message="the decode's KV layout differs"))
            return
        base = payload.ctypes.data
        srcs, dsts, lens = [], [], []
        for start, end in _runs(target.slots):
            for p, dst in enumerate(target.buffers):
                srcs.append(base + (p * n + start) * row)
                dsts.append(dst + target.slots[start] * row)
                lens.append((end - start) * row)
        if self.engine.register_memory(base, payload.nbytes) != 0:
            write_frame(conn, Gone(room=want.room, message="Mooncake cannot register the KV"))
            return
        try:
            rc = self.engine.batch_transfer_sync_write(target.session, srcs, dsts, lens)
        finally:
            self.engine.unregister_memory(base)
        if rc != 0:
            message = f"the Mooncake write to {target.session} failed ({rc})"
            write_frame(conn, Gone(room=want.room, message=message))
            return
        write_frame(conn, Data(room=want.room, num_tokens=n, nbytes=0, meta=ready.meta))


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``slots`` whose values are consecutive."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


def _local_address() -> str:
    """This machine's address on its default route (no packet is sent), else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


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
