"""KV connector ``nixl``: the prefill writes KV straight into the decode's KV pool with NIXL
(its UCX backend: RDMA, shared memory or TCP, whatever UCX finds; on CPU machines it runs over
shared memory or TCP on loopback).

Control channel, staging and write layout: ``remote_write.py`` (a GPU pool's KV is staged on
its GPU, ``RADIXSERVE_NIXL_STAGING=host``: in host memory). The decode registers its pool's
per-layer buffers with its NIXL agent at start and sends the agent's metadata in each ``Want``;
the prefill adds that agent once, registers a room's staged KV, posts one WRITE transfer and
waits for it (up to --disaggregation-transfer-timeout), then deregisters the KV. The NIXL
Python API comes from the ``nixl`` meta package or directly from ``nixl-cu12``/``nixl-cu13``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
import time
import uuid
from typing import Any

import msgspec

from radixserve.core.hookspecs import hookimpl
from radixserve.core.memory import KVPool
from radixserve.plugins.kv_transfer.remote_write import RemoteWriteConnector, Writes, WriteTarget

logger = logging.getLogger(__name__)

NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")  # the meta package, then its variants
POLL_S = 0.0005
STAGING_ENV = "RADIXSERVE_NIXL_STAGING"  # where a room's KV waits on a GPU prefill


class NixlAgentInfo(msgspec.Struct, kw_only=True):
    metadata: bytes  # nixl_agent.get_agent_metadata()
    mem_type: str  # "DRAM" or "VRAM": where the decode's pool lives
    device: int


_info = msgspec.msgpack.Decoder(NixlAgentInfo)


def _nixl_api() -> Any:
    for name in NIXL_MODULES:
        if importlib.util.find_spec(name) is not None:
            try:
                return importlib.import_module(f"{name}._api")
            except ImportError as e:
                raise RuntimeError(f"kv_transfer 'nixl' cannot load {name}: {e}") from e
    raise RuntimeError("kv_transfer 'nixl': no NIXL package is installed (pip install nixl)")


class NixlKVConnector(RemoteWriteConnector):
    def __init__(self) -> None:
        super().__init__()
        self.nixl: Any = None
        self.name = ""
        self.mem_type, self.device = "DRAM", 0
        self._remotes: dict[str, str] = {}  # decode agent name -> name NIXL gave it here
        self._pool_regions: Any = None  # the decode's registered pool
        self._nixl_lock = threading.Lock()

    def start(self, role: str, kv_pool: KVPool, bootstrap_port: int, timeout: float) -> None:
        api = _nixl_api()
        super().start(role, kv_pool, bootstrap_port, timeout)
        # UCX writes GPU to GPU (cuda_ipc: NVLink between GPUs of one host)
        self.device_staging = os.environ.get(STAGING_ENV, "device") != "host"
        self.name = f"radixserve-{role}-{uuid.uuid4().hex[:12]}"
        self.nixl = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        device = kv_pool.k[0].device
        self.mem_type = "DRAM" if device.type == "cpu" else "VRAM"
        self.device = device.index or 0
        if role == "decode":
            regions = [(t.data_ptr(), t.nbytes, self.device, "") for t in self.pool_buffers()]
            self._pool_regions = self.nixl.register_memory(regions, self.mem_type)
        logger.info("NIXL agent %s (UCX, %s), %s side", self.name, self.mem_type, role)

    def close(self) -> None:
        """Let the agent go in order (an agent left to the interpreter's exit can crash or
        hang it)."""
        super().close()
        with self._nixl_lock:
            nixl, self.nixl = self.nixl, None
            if nixl is None:
                return
            if self._pool_regions is not None:
                nixl.deregister_memory(self._pool_regions)
            for remote in self._remotes.values():
                nixl.remove_remote_agent(remote)
            self._remotes.clear()
        del nixl

    def agent(self) -> tuple[str, bytes]:
        info = NixlAgentInfo(
            metadata=self.nixl.get_agent_metadata(), mem_type=self.mem_type, device=self.device
        )
        return self.name, msgspec.msgpack.encode(info)

    def write(self, target: WriteTarget, writes: Writes) -> str | None:
        nixl = self.nixl
        info = _info.decode(target.agent_info)
        with self._nixl_lock:
            remote = self._remotes.get(target.agent)
            if remote is None:
                remote = self._remotes[target.agent] = nixl.add_remote_agent(info.metadata)
            mem, dev = ("DRAM", 0) if writes.src_device < 0 else ("VRAM", writes.src_device)
            staged = nixl.register_memory([(writes.src_base, writes.src_nbytes, dev, "")], mem)
        try:
            pairs = zip(writes.srcs, writes.lens, strict=True)
            src = nixl.get_xfer_descs([(a, n, dev) for a, n in pairs], mem)
            pairs = zip(writes.dsts, writes.lens, strict=True)
            dst = nixl.get_xfer_descs([(a, n, info.device) for a, n in pairs], info.mem_type)
            handle = nixl.initialize_xfer("WRITE", src, dst, remote)
            try:
                state = nixl.transfer(handle)
                deadline = time.monotonic() + self.timeout
                while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                    state = nixl.check_xfer_state(handle)
            finally:
                nixl.release_xfer_handle(handle)
        finally:
            with self._nixl_lock:
                nixl.deregister_memory(staged)
        if state == "DONE":
            return None
        return f"the NIXL write to {target.agent} ended in state {state}"


def _available() -> str | None:
    if not any(importlib.util.find_spec(name) is not None for name in NIXL_MODULES):
        return "no NIXL package is installed (pip install nixl, or nixl-cu12 on CPU machines)"
    return None


@hookimpl
def register_kv_connectors(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "nixl",
        NixlKVConnector,
        available=_available,
        description="NIXL (UCX) writes KV into the decode's pool",
    )
