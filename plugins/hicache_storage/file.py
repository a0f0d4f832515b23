"""HiCache storage ``file``: one file per KV page in a directory (``{"dir": PATH}`` in
``--hicache-storage-backend-extra-config``; default ``$TMPDIR/radixserve_hicache``), named by
the page's key, so pages outlive the server and a restarted one finds them. Writes go to a
temporary name and are renamed over the final one, so a reader never sees half a page."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from radixserve.core.hicache_storage import HiCacheStorage
from radixserve.core.hookspecs import hookimpl


class FileStorage(HiCacheStorage):
    def __init__(self, extra_config: dict[str, Any]) -> None:
        default = Path(tempfile.gettempdir()) / "radixserve_hicache"
        self.dir = Path(extra_config.get("dir") or default)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key.isalnum():
            raise ValueError(f"bad page key {key!r}")
        return self.dir / f"{key}.kv"

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def get(self, key: str, out: torch.Tensor) -> bool:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return False
        flat = out.view(-1).view(torch.uint8)
        if len(data) != flat.numel():
            return False
        flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return True

    def set(self, key: str, value: torch.Tensor) -> bool:
        path = self._path(key)
        data = value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True

    def clear(self) -> None:
        for path in self.dir.glob("*.kv"):
            path.unlink(missing_ok=True)


@hookimpl
def register_hicache_storage_backends(register) -> None:  # type: ignore[no-untyped-def]
    register("file", FileStorage, description="KV pages as files in a directory")
