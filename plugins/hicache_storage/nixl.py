"""HiCache storage ``nixl``: KV pages through NIXL's file (POSIX) plugin, one file per page
in ``{"dir": PATH}``. NIXL's Python API comes from the ``nixl`` package (or ``nixl_cu12`` /
``nixl_cu13``); where none is installed the backend is listed as unavailable with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from radixserve.core.hicache_storage import HiCacheStorage
from radixserve.core.hookspecs import hookimpl

NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")


def _nixl_api() -> Any:
    for name in NIXL_MODULES:
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(f"{name}._api")
    return None


class NixlStorage(HiCacheStorage):
    """Pages move between a host tensor and a file with one NIXL transfer each (the POSIX
    backend's WRITE / READ from DRAM to FILE descriptors)."""

    def __init__(self, extra_config: dict[str, Any]) -> None:
        api = _nixl_api()
        if api is None:
            raise RuntimeError(f"the nixl storage backend is unavailable because {_available()}")
        default = Path(tempfile.gettempdir()) / "radixserve_hicache_nixl"
        self.dir = Path(extra_config.get("dir") or default)
        self.dir.mkdir(parents=True, exist_ok=True)
        # no UCX backend (none is needed for files; its teardown crashed the process at exit)
        config = api.nixl_agent_config(backends=[])
        self.agent = api.nixl_agent(f"radixserve-hicache-{os.getpid()}", config)
        if "POSIX" not in self.agent.get_plugin_list():
            raise RuntimeError(
                "the nixl storage backend is unavailable because NIXL's POSIX plugin is not "
                "installed with it"
            )
        self.agent.create_backend("POSIX")

    def _path(self, key: str) -> Path:
        if not key.isalnum():
            raise ValueError(f"bad page key {key!r}")
        return self.dir / f"{key}.kv"

    def _transfer(self, op: str, key: str, tensor: torch.Tensor, create: bool) -> bool:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(self._path(key), flags, 0o600)
        try:
            size = tensor.numel() * tensor.element_size()
            if create:
                os.ftruncate(fd, size)
            files = self.agent.register_memory([(0, size, fd, "")], "FILE")
            mem = self.agent.register_memory(tensor)
            try:
                handle = self.agent.initialize_xfer(op, mem.trim(), files.trim(), self.agent.name)
                state = self.agent.transfer(handle)
                while state == "PROC":
                    state = self.agent.check_xfer_state(handle)
                self.agent.release_xfer_handle(handle)
                return state == "DONE"
            finally:
                self.agent.deregister_memory(mem)
                self.agent.deregister_memory(files)
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def get(self, key: str, out: torch.Tensor) -> bool:
        path = self._path(key)
        if not path.is_file() or path.stat().st_size != out.numel() * out.element_size():
            return False
        return self._transfer("READ", key, out, create=False)

    def set(self, key: str, value: torch.Tensor) -> bool:
        return self._transfer("WRITE", key, value.contiguous(), create=True)

    def clear(self) -> None:
        for path in self.dir.glob("*.kv"):
            path.unlink(missing_ok=True)


def _available() -> str | None:
    # NOTE: only find_spec: listing plugins must not import a vendor library.
    if not any(importlib.util.find_spec(name) for name in NIXL_MODULES):
        return (
            "no NIXL Python package is installed (nixl, nixl_cu12 or nixl_cu13; "
            "pip install nixl); its POSIX file plugin is what this backend uses"
        )
    return None


@hookimpl
def register_hicache_storage_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "nixl", NixlStorage, available=_available,
        description="KV pages as files through NIXL's POSIX plugin",
    )  # fmt: skip
