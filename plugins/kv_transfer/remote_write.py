"""What the connectors whose prefill writes KV straight into the decode's pool share
(``mooncake``, ``nixl``): the ``tcp`` connector's control channel, with the decode's ``Want``
carrying a ``WriteTarget`` (how to reach its transfer agent, the addresses of its pool's
per-layer K and V buffers, the room's slots), and the prefill answering with a ``Data`` frame of
0 bytes once its write is done.

The prefill stages the prompt's KV when the engine hands it over (``send`` must leave the slots
free for reuse) and writes from there: one entry per run of consecutive slots and per K or V
buffer of each layer. Staged in host memory, or, for a connector that can write from GPU memory
(``device_staging``), in a buffer on the pool's GPU: a device-to-device gather instead of a copy
to the host that would stall the prefill's engine thread (an 8k-token prompt of an 8B model is
1 GiB of KV).
"""

from __future__ import annotations

import socket
from abc import abstractmethod
from typing import Any

import msgspec
import torch

from radixserve.plugins.kv_transfer.tcp import (
    Data,
    Gone,
    PeerError,
    TcpKVConnector,
    Want,
    write_frame,
)


class WriteTarget(msgspec.Struct, kw_only=True):
    """Where a decode wants a room's KV written."""

    agent: str  # the decode's transfer agent (a Mooncake session, a NIXL agent name)
    agent_info: bytes  # what the prefill needs to reach it (NIXL: its agent metadata)
    buffers: list[int]  # base address of K then V of each layer of the decode's pool
    row_bytes: int  # bytes of one token's K (or V) in one layer
    slots: list[int]


class Writes(msgspec.Struct, kw_only=True):
    """One room's write: source and destination addresses and lengths, in bytes."""

    src_base: int  # the staged KV on the prefill
    src_nbytes: int
    srcs: list[int]
    dsts: list[int]
    lens: list[int]
    src_device: int = -1  # the GPU the staged KV is on; -1: host memory


class DeviceStaged:
    """A room's KV gathered on the prefill's GPU: uint8 [2 * layers, tokens, row bytes],
    complete once ``ready`` (a CUDA event recorded after the gather) has fired."""

    __slots__ = ("data", "ready")

    def __init__(self, data: torch.Tensor, ready: Any) -> None:
        self.data, self.ready = data, ready


_target = msgspec.msgpack.Decoder(WriteTarget)


class RemoteWriteConnector(TcpKVConnector):
    #: Whether ``write`` can read from GPU memory (``Writes.src_device``): then a pool on a GPU
    #: stages a room's KV on that GPU, else in host memory.
    device_staging = False

    @abstractmethod
    def agent(self) -> tuple[str, bytes]:
        """(name, info) of this side's transfer agent, sent in the decode's ``Want``."""

    @abstractmethod
    def write(self, target: WriteTarget, writes: Writes) -> str | None:
        """Prefill: do ``writes`` into ``target``'s memory, synchronously (this runs on the
        connection's thread); None on success, else why it failed."""

    def pool_buffers(self) -> list[torch.Tensor]:
        pool = self.pool
        assert pool is not None
        return [t for layer in range(len(pool.k)) for t in (pool.k[layer], pool.v[layer])]

    # -- decode ------------------------------------------------------------------------------

    def want_target(self, slots: torch.Tensor) -> bytes:
        buffers = self.pool_buffers()
        name, info = self.agent()
        target = WriteTarget(
            agent=name,
            agent_info=info,
            buffers=[t.data_ptr() for t in buffers],
            row_bytes=buffers[0][0].nbytes,
            slots=slots.tolist(),
        )
        return msgspec.msgpack.encode(target)

    def receive_payload(self, conn: socket.socket, frame: Data, slots: torch.Tensor) -> None:
        if frame.nbytes != 0:
            raise PeerError("the prefill streamed KV bytes: the two servers' connectors differ")
        return None

    # -- prefill -------------------------------------------------------------------------------

    def stage(self, data: torch.Tensor) -> Any:
        if not (self.device_staging and data.is_cuda):
            return super().stage(data)
        ready = torch.cuda.Event()
        ready.record()  # on the engine's stream, after the gather
        return DeviceStaged(data.view(torch.uint8).flatten(2), ready)

    def send_data(self, conn: socket.socket, want: Want, ready: Any) -> None:
        try:
            target = _target.decode(want.target)
        except msgspec.DecodeError as e:
            message = f"the decode sent no write target ({e}): the two servers' connectors differ"
            write_frame(conn, Gone(room=want.room, message=message))
            return
        # uint8 [2 * layers, tokens, row bytes], contiguous: host (numpy) or device memory
        staged = ready.payload
        payload = staged.data if isinstance(staged, DeviceStaged) else staged
        parts, n, row = payload.shape[0], payload.shape[1], payload[0, 0].nbytes
        if row != target.row_bytes or parts != len(target.buffers) or n != len(target.slots):
            write_frame(conn, Gone(room=want.room, message="the decode's KV layout differs"))
            return
        if isinstance(staged, DeviceStaged):
            torch.cuda.set_device(payload.device)  # this thread's CUDA context, for the write
            staged.ready.synchronize()  # the gather has run (the engine queued it)
            base, device = payload.data_ptr(), payload.device.index or 0
        else:
            base, device = payload.ctypes.data, -1
        writes = Writes(src_base=base, src_nbytes=payload.nbytes, srcs=[], dsts=[], lens=[],
                        src_device=device)  # fmt: skip
        for start, end in runs(target.slots):
            for p, dst in enumerate(target.buffers):
                writes.srcs.append(base + (p * n + start) * row)
                writes.dsts.append(dst + target.slots[start] * row)
                writes.lens.append((end - start) * row)
        problem = self.write(target, writes)
        if problem is not None:
            write_frame(conn, Gone(room=want.room, message=problem))
            return
        write_frame(conn, Data(room=want.room, num_tokens=n, nbytes=0, meta=ready.meta))


def runs(slots: list[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``slots`` whose values are consecutive."""
    out, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            out.append((start, i))
            start = i
    return out


def local_address() -> str:
    """This machine's address on its default route (no packet is sent), else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
