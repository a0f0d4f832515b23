"""HiCache's third tier: the storage-backend contract, the page keys and a guard that turns a
failing backend into misses.

A storage backend keeps KV pages keyed by strings. A page's key is a hash chain over the
token prefix that ends with it (and the model's namespace and the request's extra key), so
the same prefix maps to the same keys in another process, or after a restart. Backends are
plugins of the kind ``hicache_storage`` (``register_hicache_storage_backends``): ``factory(
extra_config: dict)`` builds one (``--hicache-storage-backend-extra-config``).
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from array import array
from typing import Any

import torch

logger = logging.getLogger(__name__)


class HiCacheStorage(ABC):
    """A key -> KV page store. A page is a contiguous host tensor; ``get`` fills ``out`` (of
    the page's shape and dtype) in place. Any method may raise: the core counts a raise as a
    miss (or a skipped write) and recomputes, it never fails a request for it."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a page is stored under ``key``."""

    @abstractmethod
    def get(self, key: str, out: torch.Tensor) -> bool:
        """Fill ``out`` with the page under ``key``; False when there is none (or it is of
        another size)."""

    @abstractmethod
    def set(self, key: str, value: torch.Tensor) -> bool:
        """Store ``value`` under ``key``; True when stored."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every page."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Let go of connections or files (the engine shuts down). Default: nothing."""


def page_keys(
    tokens: list[int], page_size: int, namespace: str, extra_key: str | None, num_pages: int
) -> list[str]:
    """The keys of the first ``num_pages`` whole pages of ``tokens``: page i's key hashes the
    key of page i-1 with the tokens of page i."""
    seed = f"{namespace}\x00{extra_key or ''}".encode()
    digest = hashlib.sha256(seed).digest()
    keys: list[str] = []
    for i in range(num_pages):
        page = array("q", tokens[i * page_size : (i + 1) * page_size]).tobytes()
        digest = hashlib.sha256(digest + page).digest()
        keys.append(digest.hex())
    return keys


class GuardedStorage:
    """A backend whose failures become misses: every error is counted and logged (the first
    one, and then every hundredth), never raised."""

    def __init__(self, backend: HiCacheStorage, name: str) -> None:
        self.backend = backend
        self.name = name
        self.errors = 0

    def _failed(self, what: str, error: Exception) -> None:
        self.errors += 1
        if self.errors % 100 == 1:
            logger.warning(
                "hicache storage %s: %s failed (%r); recomputing instead (%d errors so far)",
                self.name, what, error, self.errors,
            )  # fmt: skip

    def _guarded(self, what: str, *args: Any) -> bool:
        """``backend.<what>(*args)`` as a bool; False when it raises."""
        try:
            return bool(getattr(self.backend, what)(*args))
        except Exception as e:  # noqa: BLE001 - a failing tier degrades to recompute
            self._failed(what, e)
            return False

    def exists(self, key: str) -> bool:
        return self._guarded("exists", key)

    def get(self, key: str, out: torch.Tensor) -> bool:
        return self._guarded("get", key, out)

    def set(self, key: str, value: torch.Tensor) -> bool:
        return self._guarded("set", key, value)

    def clear(self) -> bool:
        try:
            self.backend.clear()
            return True
        except Exception as e:  # noqa: BLE001 - reported to the caller as False
            self._failed("clear", e)
            return False

    def close(self) -> None:
        try:
            self.backend.close()
        except Exception as e:  # noqa: BLE001 - closing must not fail a shutdown
            self._failed("close", e)
