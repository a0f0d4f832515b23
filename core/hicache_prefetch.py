"""HiCache prefetch (``--enable-hicache-prefetch``): while a request waits in the queue, the
part of its prefix that lives in storage is read toward host memory, and the part in host
memory is loaded onto the device when the device pool has room, so that admission finds it
there instead of loading it then.

A step strategy (core/interfaces.py): ``admit`` starts a storage read for the pages after the
prefix the tree holds (device and host); one background thread runs the reads, each page into
a tensor of its own (never into a pool), so the engine thread's pools and tree are never
touched off it, and a request that ends while queued (``ended``) only marks its read cancelled:
it holds nothing to free. On the engine thread, a finished read *lands*: its pages get host
slots and become a host node of the tree (as a storage match does, core/hicache.py). Admission
(``admissible``) follows ``--hicache-storage-prefetch-policy``: ``best_effort`` lands what has
arrived and lets the request start, ``wait_complete`` lets it start once its read finished,
``timeout`` once finished or after ``prefetch_timeout_base + prefetch_timeout_per_ki_token *
tokens / 1024`` seconds (from ``--hicache-storage-backend-extra-config``, as SGLang's). With
prefetch on, ``match_prefix`` no longer reads storage itself.

Host -> device happens in ``poll`` (before each step) for the first queued requests, once
each, within the free and evictable slots beyond what the running requests still need
(``Admission.kv_reserve``; their own prefixes are locked, so eviction never takes them); what
it loads is evictable cache like any other, LRU-fresh.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.core.admission import match_limit
from radixserve.core.hicache import HiRadixCache, HiTreeNode
from radixserve.core.hicache_storage import page_keys
from radixserve.core.interfaces import StepStrategy
from radixserve.core.request import Req, ReqState

logger = logging.getLogger(__name__)
LOAD_AHEAD = 8  # queued requests (in queue order) whose host part may go to the device


@dataclass(eq=False)
class _Read:
    """One request's storage read: pages ``first``, ``first + 1``, ... of ``key``."""

    key: list[int]
    extra_key: str | None
    first: int  # index of the first page read
    max_pages: int
    deadline: float
    pages: list[torch.Tensor] = field(default_factory=list)  # appended by the worker
    cancelled: bool = False  # set by the engine thread: the worker stops at the next page
    done: threading.Event = field(default_factory=threading.Event)
    landed: bool = False


@dataclass(eq=False)
class _Queued:
    req: Req
    key: list[int]
    read: _Read | None
    loaded: bool = False  # its host part went to the device


class HiCachePrefetch(StepStrategy):
    def __init__(
        self, cache: HiRadixCache, scheduler: Any, policy: str, extra: dict[str, Any]
    ) -> None:
        self.cache = cache
        self.scheduler = scheduler
        self.policy = policy
        self.timeout_base = float(extra.get("prefetch_timeout_base", 1.0))
        self.timeout_per_ki = float(extra.get("prefetch_timeout_per_ki_token", 0.25))
        self.queued: dict[str, _Queued] = {}
        self._reads: queue.Queue[_Read | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        if cache.storage is not None:
            cache.sync_storage = False  # storage is read here, off the engine thread

    # -- the request lifecycle ----------------------------------------------------------------

    def admit(self, req: Any, compiling: bool) -> bool:
        if req.pooling is not None:
            return False
        p = self.cache.page_size
        key = req.fill_ids()[: match_limit(req)]
        key = key[: len(key) - len(key) % p]
        read = None
        held, _ = self.cache.peek_prefix(key, req.extra_key)
        if self.cache.storage is not None and len(key) - held >= p:
            tokens = len(key) - held
            wait = self.timeout_base + self.timeout_per_ki * tokens / 1024
            max_pages = self.cache.host.size // 2 // p  # landing must fit beside the rest
            read = _Read(key, req.extra_key, held // p, max_pages, time.monotonic() + wait)
            self._start(read)
        self.queued[req.rid] = _Queued(req, key, read)
        return False

    def admissible(self, req: Any) -> bool:
        entry = self.queued.get(req.rid)
        read = entry.read if entry is not None else None
        if entry is None or read is None or read.landed:
            return True
        if not read.done.is_set():
            if self.policy == "wait_complete":
                return False
            if self.policy == "timeout" and time.monotonic() < read.deadline:
                return False
        self._land(entry)
        return True

    def poll(self) -> list[Any]:
        for rid, entry in list(self.queued.items()):
            if entry.req.state is not ReqState.WAITING:
                self._forget(rid)  # admitted (ended ones come through ``ended``)
            elif entry.read is not None and entry.read.done.is_set() and not entry.read.landed:
                self._land(entry)
        self._load_ahead()
        return []

    def ended(self, reqs: list[Any]) -> None:
        for req in reqs:
            if req.finished and req.rid in self.queued:
                entry = self._forget(req.rid)
                if entry.read is not None and not entry.read.landed:
                    self.cache.stats.prefetch_cancelled += 1

    def refused(self, req: Any, message: str) -> None:
        entry = self.queued.get(req.rid)
        if entry is not None and entry.req is req:  # refused after ``admit`` started a read
            self._forget(req.rid)

    def ended_unscheduled(self, reqs: list[Any]) -> None:
        self.ended(reqs)  # their grammar failed to compile while they were queued with us

    def close(self) -> None:
        for rid in list(self.queued):
            self._forget(rid)
        if self._worker is not None:
            self._reads.put(None)

    def _forget(self, rid: str) -> _Queued:
        entry = self.queued.pop(rid)
        if entry.read is not None:
            entry.read.cancelled = True
        return entry

    # -- storage -> host (the worker thread reads, the engine thread lands) -------------------

    def _start(self, read: _Read) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="hicache-prefetch", daemon=True)
            self._worker.start()
        self._reads.put(read)

    def _run(self) -> None:
        cache = self.cache
        storage, p = cache.storage, cache.page_size
        assert storage is not None
        while (read := self._reads.get()) is not None:
            try:
                keys = page_keys(read.key, p, cache.namespace, read.extra_key, len(read.key) // p)
                for page_key in keys[read.first : read.first + read.max_pages]:
                    if read.cancelled or not storage.exists(page_key):
                        break
                    page = torch.empty(cache.host.page_shape(p), dtype=cache.host.dtype)
                    if read.cancelled or not storage.get(page_key, page):
                        break
                    read.pages.append(page)
            finally:
                read.done.set()

    def _land(self, entry: _Queued) -> None:
        """Put what ``entry``'s read has brought into host slots, as a host node after the
        prefix the tree holds now; the rest of the read is cancelled."""
        read = entry.read
        assert read is not None
        read.cancelled, read.landed = True, True
        pages = list(read.pages)  # those the worker finished
        cache, p = self.cache, self.cache.page_size
        path, _ = cache._walk(read.key, read.extra_key)
        held = sum(len(n.key) for n in path) // p
        usable = pages[held - read.first :] if read.first <= held else []
        if not usable:
            return  # nothing new, or the tree lost pages before the read's first one
        nodes: list[HiTreeNode] = path  # type: ignore[assignment]
        for node in nodes:
            node.host_ref += 1  # host eviction must not take the prefix we attach to
        try:
            slots = cache._alloc_host(len(usable) * p)
        finally:
            for node in nodes:
                node.host_ref -= 1
        if slots is None:
            return
        cache.host.write_pages(slots, torch.cat(usable))
        parent = path[-1] if path else cache._root(read.extra_key)
        node = HiTreeNode(read.key[held * p : (held + len(usable)) * p], None, parent)
        node.host_value, node.stored = slots, True
        node.last_access = next(cache._clock)
        parent.children[cache._child_key(node.key)] = node
        cache.stats.prefetch_storage_tokens += len(node.key)
        entry.loaded = False  # its new host part may go to the device too

    # -- host -> device -----------------------------------------------------------------------

    def _load_ahead(self) -> None:
        """Load the host part of the first queued requests' prefixes into device slots that
        the running requests do not need."""
        cache = self.cache
        room = cache.allocator.available() + cache.evictable_size
        room -= int(self.scheduler.kv_reserve()) + 1
        for entry in list(self.queued.values())[:LOAD_AHEAD]:
            if entry.loaded or room <= 0:
                continue
            on_host = self._host_tokens(entry)
            if on_host > room:
                continue
            entry.loaded = True
            if not on_host:
                continue
            path, _ = cache._walk(entry.key, entry.req.extra_key)
            nodes: list[HiTreeNode] = path  # type: ignore[assignment]
            above = [n for n in nodes if n.value is not None]
            tail = nodes[len(above) :]
            if sum(len(n.key) for n in tail) > room:
                continue  # a split made it longer than counted
            loaded = cache._load(tail, above)
            tokens = sum(len(n.key) for n in loaded)
            cache.stats.prefetch_device_tokens += tokens
            room -= tokens

    def _host_tokens(self, entry: _Queued) -> int:
        """Tokens of ``entry``'s prefix that the tree holds in host memory only (read-only)."""
        cache, key = self.cache, entry.key
        node = cache._roots.get(entry.req.extra_key)
        matched = on_host = 0
        while node is not None and matched < len(key):
            child = node.children.get(cache._child_key(key[matched:]))
            if child is None or child.key != key[matched : matched + len(child.key)]:
                break  # a partial match is loaded at admission (it splits the node)
            matched += len(child.key)
            on_host += len(child.key) if child.value is None else 0
            node = child
        return on_host


def build(core: Any) -> HiCachePrefetch | None:
    """The prefetch strategy of ``core`` (an EngineCore), or None with prefetch off."""
    config = core.config
    if not config.enable_hicache_prefetch or not isinstance(core.cache, HiRadixCache):
        return None
    extra = json.loads(config.hicache_storage_backend_extra_config or "{}")
    return HiCachePrefetch(core.cache, core.scheduler, config.hicache_storage_prefetch_policy,
                           extra)  # fmt: skip
