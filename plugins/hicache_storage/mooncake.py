"""HiCache storage ``mooncake``: KV pages in a Mooncake Store (``mooncake.store``'s
MooncakeDistributedStore, from the ``mooncake-transfer-engine`` wheels). It needs a running
``mooncake_master`` and a metadata server; the extra config names them::

    {"master_server_address": "127.0.0.1:50051", "metadata_server": "P2PHANDSHAKE",
     "local_hostname": "127.0.0.1", "protocol": "tcp", "device_name": "",
     "global_segment_size": 268435456, "local_buffer_size": 67108864}

Pages are stored as raw bytes under their keys (``put`` / ``get`` / ``is_exist``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from radixserve.core.hicache_storage import HiCacheStorage
from radixserve.core.hookspecs import hookimpl

_DEFAULTS: dict[str, Any] = {
    "local_hostname": "127.0.0.1",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": 256 << 20,
    "local_buffer_size": 64 << 20,
    "protocol": "tcp",
    "device_name": "",
    "master_server_address": "127.0.0.1:50051",
}


class MooncakeStorage(HiCacheStorage):
    def __init__(self, extra_config: dict[str, Any]) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # the registry said why; say it again, with the cause
            raise RuntimeError(f"hicache_storage 'mooncake' cannot load Mooncake: {e}") from e

        cfg = {**_DEFAULTS, **extra_config}
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            cfg["local_hostname"], cfg["metadata_server"], int(cfg["global_segment_size"]),
            int(cfg["local_buffer_size"]), cfg["protocol"], cfg["device_name"],
            cfg["master_server_address"],
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(
                f"the mooncake storage backend is unavailable because the store's setup failed "
                f"(code {rc}); is mooncake_master running at {cfg['master_server_address']}?"
            )

    def exists(self, key: str) -> bool:
        return int(self.store.is_exist(key)) == 1

    def get(self, key: str, out: torch.Tensor) -> bool:
        data = self.store.get(key)
        flat = out.view(-1).view(torch.uint8)
        if not data or len(data) != flat.numel():
            return False
        flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return True

    def set(self, key: str, value: torch.Tensor) -> bool:
        data = value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return int(self.store.put(key, data)) == 0

    def clear(self) -> None:
        self.store.remove_all()

    def close(self) -> None:
        self.store.close()


def _available() -> str | None:
    # NOTE: only find_spec: listing plugins must not import a vendor library.
    if importlib.util.find_spec("mooncake") is None:
        return (
            "the Mooncake package is not installed (pip install mooncake-transfer-engine, or "
            "mooncake-transfer-engine-non-cuda on CPU machines)"
        )
    return None


@hookimpl
def register_hicache_storage_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "mooncake", MooncakeStorage, available=_available,
        description="KV pages in a Mooncake Store (needs mooncake_master)",
    )  # fmt: skip
