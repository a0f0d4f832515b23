"""core/hicache_prefetch.py engine-free: a real HiRadixCache on a CPU device pool, a host pool
and an in-memory storage backend, real requests, a scheduler standing in for its
``kv_reserve``. Reads are awaited through their ``done`` events and a gate the test opens
(never a sleep); each slot's KV is a fingerprint of its token, so what lands and loads is
checked by its KV (test_hicache_prefetch.py runs prefetch in the engine, ~30 s)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kv_fingerprints import kv_tokens, write_fingerprints

from radixserve.core.hicache import HiRadixCache, HiTreeNode
from radixserve.core.hicache_pool import HostKVPool
from radixserve.core.hicache_prefetch import LOAD_AHEAD, HiCachePrefetch, build
from radixserve.core.hicache_storage import GuardedStorage, HiCacheStorage, page_keys
from radixserve.core.memory import KVPool, ReqToTokenPool, TokenAllocator
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import FinishReason, Req, ReqState, SamplingParams

LAYERS, HEADS, HEAD_DIM, P = 2, 1, 2, 2
WAIT = 30.0  # seconds a test waits for the worker at most (it takes milliseconds)


class Storage(HiCacheStorage):
    """Pages in a dict. While ``gate`` is set to an unset Event, each ``get`` waits on it."""

    def __init__(self) -> None:
        self.pages: dict[str, torch.Tensor] = {}
        self.gate: threading.Event | None = None
        self.entered = threading.Semaphore(0)  # released as each get starts
        self.gets: list[str] = []
        self.missing: set[str] = set()  # exists() says no
        self.fail_get: set[str] = set()

    def exists(self, key: str) -> bool:
        return key in self.pages and key not in self.missing

    def get(self, key: str, out: torch.Tensor) -> bool:
        self.gets.append(key)
        self.entered.release()
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        if key in self.fail_get:
            return False
        out.copy_(self.pages[key])
        return True

    def set(self, key: str, value: torch.Tensor) -> bool:
        self.pages[key] = value.clone()
        return True

    def clear(self) -> None:
        self.pages.clear()


def make(storage: Storage | None, device: int = 32, host: int = 64) -> HiRadixCache:
    dev = KVPool(device, LAYERS, HEADS, HEAD_DIM, torch.float32, "cpu")
    host_pool = HostKVPool(dev, host, P, "layer_first", "direct")
    guarded = GuardedStorage(storage, "mem") if storage is not None else None
    return HiRadixCache(
        TokenAllocator(device, P), ReqToTokenPool(2, 64), host_pool, "write_back", guarded, "m"
    )


def put(cache: HiRadixCache, tokens: list[int], extra_key: str | None = None) -> None:
    """``tokens`` inserted on the device with their fingerprints."""
    slots = cache.allocator.alloc(len(tokens))
    assert slots is not None
    write_fingerprints(cache, slots, tokens)
    assert cache.insert(tokens, slots, extra_key) == 0


def stored(tokens: list[int], extra_key: str | None = None) -> Storage:
    """A storage holding ``tokens``' pages (written by another cache's eviction)."""
    store = Storage()
    writer = make(store, device=64, host=128)
    put(writer, tokens, extra_key)
    writer.evict(len(tokens))
    assert len(store.pages) == len(tokens) // P
    return store


class Sched:
    def __init__(self, reserve: int = 0) -> None:
        self.reserve = reserve

    def kv_reserve(self) -> int:
        return self.reserve


def req(rid: str, tokens: list[int], extra_key: str | None = None) -> Req:
    return Req(rid, tokens, SamplingParams(max_new_tokens=4), extra_key)


def prefetch(cache: HiRadixCache, policy: str = "best_effort", reserve: int = 0,
             **extra: float) -> HiCachePrefetch:  # fmt: skip
    return HiCachePrefetch(cache, Sched(reserve), policy, extra)


def done(pf: HiCachePrefetch, r: Req) -> Any:
    read = pf.queued[r.rid].read
    assert read is not None and read.done.wait(WAIT)
    return read


def host_node(cache: HiRadixCache, tokens: list[int], extra_key: str | None = None) -> HiTreeNode:
    node = cache._root(extra_key).children[cache._child_key(tokens)]
    assert isinstance(node, HiTreeNode)
    return node


A = [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_queued_request_reads_storage_lands_on_the_host_and_loads_on_the_device() -> None:
    store = stored(A)
    cache = make(store)
    assert cache.sync_storage is True
    pf = prefetch(cache)
    assert cache.sync_storage is False  # the prefetch reads storage, not match_prefix
    r = req("a", A + [9])
    before = time.monotonic()
    assert pf.admit(r, False) is False
    after = time.monotonic()
    entry = pf.queued["a"]
    assert entry.req is r and entry.key == A and not entry.loaded
    read = done(pf, r)
    assert cache.host.size == 62  # 64 less the reserved page
    assert (read.key, read.extra_key, read.first, read.max_pages) == (A, None, 0, 15)
    wait = 1.0 + 0.25 * 8 / 1024  # the defaults
    assert before + wait <= read.deadline <= after + wait
    assert [p.shape for p in read.pages] == [(P, LAYERS, 2, HEADS, HEAD_DIM)] * 4
    assert store.gets == page_keys(A, P, "m", None, 4)
    assert not read.landed
    assert pf.poll() == []
    assert read.landed and read.cancelled
    node = host_node(cache, A)
    assert node.key == A and node.stored and node.host_value is not None
    assert cache.stats.prefetch_storage_tokens == 8
    # room on the device: the host part went there too, evictable cache like any other
    assert node.value is not None and entry.loaded
    assert cache.stats.prefetch_device_tokens == 8 and cache.evictable_size == 8
    cache.check_tiers()
    assert pf.admissible(r)  # landed: nothing to wait for
    match = cache.match_prefix(A)
    assert kv_tokens(cache, match.kv_indices) == A
    assert cache.stats.device_hit_tokens == 8 and cache.stats.storage_hit_tokens == 0
    r.state = ReqState.PREFILL  # admitted
    pf.poll()
    assert "a" not in pf.queued
    pf.close()


def test_the_read_starts_after_the_held_prefix_and_lands_under_it() -> None:
    store = stored(A)
    cache = make(store)
    put(cache, [1, 2])  # the first page on the device
    pf = prefetch(cache)
    r = req("a", A + [9])
    pf.admit(r, False)
    read = done(pf, r)
    assert read.first == 1 and len(read.pages) == 3
    assert store.gets == page_keys(A, P, "m", None, 4)[1:]
    pf.poll()
    first = host_node(cache, [1, 2])
    [node] = first.children.values()
    assert node.key == [3, 4, 5, 6, 7, 8] and node.parent is first
    assert first.host_ref == 0  # only held while host slots were taken
    assert kv_tokens(cache, cache.match_prefix(A).kv_indices) == A
    pf.close()


def test_what_is_read_the_key_and_its_pages() -> None:
    store = stored(A, "lora")
    cache = make(store, host=10)  # landing must fit in half the host pool (8): 2 pages
    pf = prefetch(cache, prefetch_timeout_base=2.0, prefetch_timeout_per_ki_token=512.0)
    r = req("a", A + [9, 10], "lora")  # 10 tokens: 9 may match, 8 in whole pages
    before = time.monotonic()
    pf.admit(r, False)
    read = done(pf, r)
    assert read.key == A and read.extra_key == "lora" and read.max_pages == 2
    assert before + 2.0 + 4.0 <= read.deadline <= time.monotonic() + 6.0
    assert store.gets == page_keys(A, P, "m", "lora", 4)[:2] and len(read.pages) == 2
    pf.poll()
    assert host_node(cache, [1, 2, 3, 4], "lora").key == [1, 2, 3, 4]
    pf.close()


def test_no_read_without_storage_or_a_page_to_read() -> None:
    cache = make(None)
    pf = prefetch(cache)
    assert cache.sync_storage is True
    r = req("a", A + [9])
    assert pf.admit(r, False) is False
    assert pf.queued["a"].read is None and pf._worker is None
    assert pf.admissible(r)
    store = stored(A)
    cache = make(store)
    put(cache, [1, 2, 3, 4, 5, 6])
    pf = prefetch(cache)
    short = req("b", [1, 2, 3, 4, 5, 6, 7, 8])  # 7 may match: 6 held, no whole page after
    pf.admit(short, False)
    assert pf.queued["b"].read is None and pf.queued["b"].key == [1, 2, 3, 4, 5, 6]
    one = req("c", A + [9])  # one page after the held ones
    pf.admit(one, False)
    assert done(pf, one).first == 3
    pooled = req("d", A + [9])
    pooled.pooling = "last"
    assert pf.admit(pooled, False) is False and "d" not in pf.queued
    assert pf.admissible(req("unknown", A))
    pf.close()


def test_the_worker_stops_at_the_first_missing_or_failed_page() -> None:
    store = stored(A)
    keys = page_keys(A, P, "m", None, 4)
    store.missing.add(keys[2])
    cache = make(store)
    pf = prefetch(cache)
    r = req("a", A + [9])
    pf.admit(r, False)
    assert len(done(pf, r).pages) == 2
    pf.poll()
    assert host_node(cache, [1, 2, 3, 4]).key == [1, 2, 3, 4]
    store2 = stored(A)
    store2.fail_get.add(page_keys(A, P, "m", None, 4)[1])
    cache2 = make(store2)
    pf2 = prefetch(cache2)
    r2 = req("a", A + [9])
    pf2.admit(r2, False)
    assert len(done(pf2, r2).pages) == 1
    pf.close()
    pf2.close()


def _held(policy: str, **extra: float) -> tuple[HiRadixCache, Storage, HiCachePrefetch, Req]:
    store = stored(A)
    store.gate = threading.Event()
    cache = make(store)
    pf = prefetch(cache, policy, **extra)
    r = req("a", A + [9])
    pf.admit(r, False)
    assert store.entered.acquire(timeout=WAIT)  # the first page's get is waiting
    return cache, store, pf, r


def test_best_effort_lands_what_arrived_and_lets_the_request_start() -> None:
    cache, store, pf, r = _held("best_effort")
    read = pf.queued["a"].read
    assert pf.admissible(r)
    assert read.landed and read.cancelled and read.pages == []
    assert cache._root(None).children == {}  # nothing had arrived
    assert pf.admissible(r)  # landed once
    store.gate.set()  # type: ignore[union-attr]
    assert read.done.wait(WAIT)
    assert len(read.pages) == 1  # the get under way finished; cancelled: no more
    pf.close()


def test_wait_complete_waits_for_the_whole_read() -> None:
    cache, store, pf, r = _held("wait_complete")
    read = pf.queued["a"].read
    read.deadline = 0.0  # past: no matter under this policy
    assert not pf.admissible(r) and not read.landed
    pf.poll()
    assert not read.landed  # not done: nothing lands
    store.gate.set()  # type: ignore[union-attr]
    assert read.done.wait(WAIT)
    assert pf.admissible(r) and read.landed
    assert host_node(cache, A).key == A
    pf.close()


def test_timeout_waits_until_the_deadline() -> None:
    cache, store, pf, r = _held("timeout", prefetch_timeout_base=3600.0)
    read = pf.queued["a"].read
    assert not pf.admissible(r) and not read.landed
    read.deadline = time.monotonic()  # reached
    assert pf.admissible(r) and read.landed
    store.gate.set()  # type: ignore[union-attr]
    pf.close()
    cache, store, pf, r = _held("timeout", prefetch_timeout_base=3600.0)
    read = pf.queued["a"].read
    store.gate.set()  # type: ignore[union-attr]
    assert read.done.wait(WAIT)
    assert pf.admissible(r) and read.landed  # finished before its deadline
    assert host_node(cache, A).key == A
    pf.close()


def test_a_request_that_ends_while_queued_cancels_its_read() -> None:
    cache, store, pf, r = _held("wait_complete")
    read = pf.queued["a"].read
    other = req("b", [1])
    pf.admit(other, False)
    pf.ended([r, other])  # ``r`` has not finished: nothing happens
    assert "a" in pf.queued and not read.cancelled
    r.finish(FinishReason("abort"))
    pf.ended([r])
    assert "a" not in pf.queued and "b" in pf.queued and read.cancelled
    assert cache.stats.prefetch_cancelled == 1
    store.gate.set()  # type: ignore[union-attr]
    assert read.done.wait(WAIT)
    assert len(read.pages) == 1 and not read.landed  # the get under way, no more
    pf.ended([r])  # once
    assert cache.stats.prefetch_cancelled == 1
    other.finish(FinishReason("length", length=1))
    pf.ended_unscheduled([other])  # no read: not counted
    assert pf.queued == {} and cache.stats.prefetch_cancelled == 1
    pf.close()


def test_a_landed_read_is_not_counted_cancelled() -> None:
    store = stored(A)
    cache = make(store)
    pf = prefetch(cache)
    r = req("a", A + [9])
    pf.admit(r, False)
    done(pf, r)
    pf.poll()
    r.finish(FinishReason("stop", matched=2))
    pf.ended_unscheduled([r])
    assert "a" not in pf.queued and cache.stats.prefetch_cancelled == 0
    pf.close()


def test_refused_forgets_only_the_request_it_queued() -> None:
    cache, store, pf, r = _held("wait_complete")
    read = pf.queued["a"].read
    pf.refused(req("a", A), "same id, another request")
    assert "a" in pf.queued and not read.cancelled
    pf.refused(req("zz", A), "never queued")
    pf.refused(r, "too long")
    assert "a" not in pf.queued and read.cancelled
    store.gate.set()  # type: ignore[union-attr]
    pf.close()


def test_poll_forgets_admitted_requests_and_close_ends_the_worker() -> None:
    cache, store, pf, r = _held("wait_complete")
    read = pf.queued["a"].read
    r.state = ReqState.DECODE
    pf.poll()
    assert pf.queued == {} and read.cancelled
    store.gate.set()  # type: ignore[union-attr]
    b = req("b", A + [9])
    pf.admit(b, False)
    read_b = pf.queued["b"].read
    worker = pf._worker
    pf.close()
    assert pf.queued == {} and read_b.cancelled
    worker.join(WAIT)  # type: ignore[union-attr]
    assert not worker.is_alive()  # type: ignore[union-attr]
    assert worker.name == "hicache-prefetch" and worker.daemon  # type: ignore[union-attr]
    prefetch(make(None)).close()  # no worker: nothing to end


def test_landing_keeps_only_pages_after_what_the_tree_holds_now() -> None:
    cache, store, pf, r = _held("wait_complete")
    read = pf.queued["a"].read
    put(cache, [1, 2, 3, 4])  # meanwhile, the first two pages arrived on the device
    store.gate.set()  # type: ignore[union-attr]
    assert read.done.wait(WAIT)
    pf.poll()
    first = host_node(cache, [1, 2, 3, 4])
    [node] = first.children.values()
    assert node.key == [5, 6, 7, 8]
    assert cache.stats.prefetch_storage_tokens == 4
    assert kv_tokens(cache, cache.match_prefix(A).kv_indices) == A
    pf.close()


def test_nothing_lands_where_the_tree_lost_pages_before_the_read() -> None:
    store = stored(A)
    cache = make(store)
    put(cache, [1, 2])
    pf = prefetch(cache)
    r = req("a", A + [9])
    pf.admit(r, False)
    done(pf, r)
    cache.evict(2)  # write_back with storage: [1, 2] leaves the device for the host
    cache._evict_host(64)
    assert cache._root(None).children == {}
    pf.poll()
    assert pf.queued["a"].read.landed
    assert cache._root(None).children == {} and cache.stats.prefetch_storage_tokens == 0
    pf.close()


def test_nothing_lands_without_host_room() -> None:
    store = stored(A)
    cache = make(store, host=8)
    pf = prefetch(cache)
    r = req("a", A + [9])
    pf.admit(r, False)
    done(pf, r)
    taken = cache.host.allocator.alloc(cache.host.allocator.available())  # all held
    assert taken is not None
    pf.poll()
    assert cache._root(None).children == {} and cache.stats.prefetch_storage_tokens == 0
    pf.close()


def _on_host(cache: HiRadixCache, tokens: list[int]) -> None:
    put(cache, tokens)
    assert cache._backup(host_node(cache, tokens))
    cache.evict(len(tokens))
    node = host_node(cache, tokens)
    assert node.value is None and node.host_value is not None


def test_load_ahead_takes_the_room_beyond_the_running_requests_needs() -> None:
    cache = make(None, device=16)
    _on_host(cache, [1, 2, 3, 4])
    _on_host(cache, [5, 6, 7, 8])
    _on_host(cache, [9, 10, 11, 12])
    assert cache.allocator.available() == 14  # 16 less the reserved page
    pf = prefetch(cache, reserve=5)  # room: 14 - 5 - 1 = 8
    for rid, start in (("a", 1), ("b", 5), ("c", 9)):
        pf.admit(req(rid, list(range(start, start + 4)) + [99]), False)
    pf.poll()
    assert [pf.queued[r].loaded for r in "abc"] == [True, True, False]
    assert host_node(cache, [1, 2, 3, 4]).value is not None
    assert host_node(cache, [5, 6, 7, 8]).value is not None
    assert host_node(cache, [9, 10, 11, 12]).value is None
    assert cache.stats.prefetch_device_tokens == 8
    cache.check_tiers()


@pytest.mark.parametrize(("reserve", "loaded"), [(9, True), (10, False)])
def test_load_ahead_fits_exactly(reserve: int, loaded: bool) -> None:
    cache = make(None, device=16)
    _on_host(cache, [1, 2, 3, 4])
    pf = prefetch(cache, reserve=reserve)  # room 14 - 9 - 1 = 4: fits exactly
    pf.admit(req("a", [1, 2, 3, 4, 99]), False)
    pf.poll()
    assert pf.queued["a"].loaded is loaded
    assert (host_node(cache, [1, 2, 3, 4]).value is not None) is loaded
    assert cache.stats.prefetch_device_tokens == (4 if loaded else 0)


def test_load_ahead_takes_only_the_first_queued_requests() -> None:
    cache = make(None, device=64)
    for i in range(LOAD_AHEAD + 1):
        _on_host(cache, [100 + 2 * i, 101 + 2 * i])
    pf = prefetch(cache)
    for i in range(LOAD_AHEAD + 1):
        pf.admit(req(f"r{i}", [100 + 2 * i, 101 + 2 * i, 7]), False)
    pf.poll()
    flags = [pf.queued[f"r{i}"].loaded for i in range(LOAD_AHEAD + 1)]
    assert flags == [True] * LOAD_AHEAD + [False]
    assert cache.stats.prefetch_device_tokens == 2 * LOAD_AHEAD
    del pf.queued["r0"]
    pf.poll()  # the last one is among the first eight now
    assert pf.queued[f"r{LOAD_AHEAD}"].loaded
    assert cache.stats.prefetch_device_tokens == 2 * LOAD_AHEAD + 2


def test_load_ahead_counts_evictable_device_slots_as_room() -> None:
    cache = make(None, device=16)
    _on_host(cache, [1, 2, 3, 4])
    put(cache, [5, 6])  # evictable
    assert cache.allocator.alloc(8) is not None  # held elsewhere: 4 slots free
    pf = prefetch(cache)  # room: 4 free + 2 evictable - 1 = 5
    pf.admit(req("a", [1, 2, 3, 4, 9]), False)
    pf.poll()
    assert pf.queued["a"].loaded and host_node(cache, [1, 2, 3, 4]).value is not None
    assert cache.stats.prefetch_device_tokens == 4


def test_load_ahead_marks_loaded_once_and_skips_partial_matches() -> None:
    cache = make(None, device=16)
    _on_host(cache, [1, 2, 3, 4])
    pf = prefetch(cache)
    pf.admit(req("p", [1, 2, 5, 6, 7]), False)  # only part of the host node matches
    pf.admit(req("d", [8, 9, 10]), False)  # nothing cached
    pf.poll()
    assert pf.queued["p"].loaded and pf.queued["d"].loaded
    assert host_node(cache, [1, 2, 3, 4]).value is None  # the split is left to admission
    assert cache.stats.prefetch_device_tokens == 0
    put(cache, [8, 9])
    assert cache.evictable_size == 2
    pf.poll()  # loaded entries are not looked at again
    assert cache.stats.prefetch_device_tokens == 0
    assert pf._host_tokens(pf.queued["d"]) == 0


def test_host_tokens_counts_the_host_only_nodes_of_the_path() -> None:
    cache = make(None, device=16)
    _on_host(cache, [5, 6, 7, 8])
    put(cache, [1, 2])
    pf = prefetch(cache, reserve=100)  # no room: nothing loads
    pf.admit(req("a", [1, 2, 3]), False)
    pf.admit(req("b", [5, 6, 7, 8, 9]), False)
    pf.admit(req("c", [5, 6, 7, 8, 9], "salt"), False)
    pf.poll()
    assert not any(e.loaded for e in pf.queued.values())
    assert [pf._host_tokens(pf.queued[r]) for r in "abc"] == [0, 4, 0]


def test_build() -> None:
    on = {"enable_hicache_prefetch": True, "hicache_storage_prefetch_policy": "timeout",
          "hicache_storage_backend_extra_config": '{"prefetch_timeout_base": 5}'}  # fmt: skip
    cache = make(None)
    sched = Sched()
    core = SimpleNamespace(cache=cache, scheduler=sched, config=SimpleNamespace(**on))
    pf = build(core)
    assert isinstance(pf, HiCachePrefetch)
    assert (pf.cache, pf.scheduler, pf.policy) == (cache, sched, "timeout")
    assert (pf.timeout_base, pf.timeout_per_ki) == (5.0, 0.25)
    core.config.hicache_storage_backend_extra_config = None
    pf = build(core)
    assert pf is not None and (pf.timeout_base, pf.timeout_per_ki) == (1.0, 0.25)
    core.config.enable_hicache_prefetch = False
    assert build(core) is None
    core.config.enable_hicache_prefetch = True
    core.cache = RadixCache(TokenAllocator(4, 1), ReqToTokenPool(1, 4))
    assert build(core) is None


def extend(cache: HiRadixCache, prefix: list[int], more: list[int]) -> None:
    """``prefix + more`` inserted where ``prefix`` is cached on the device: a child node."""
    held = cache.match_prefix(prefix).kv_indices
    slots = cache.allocator.alloc(len(more))
    assert slots is not None
    dev = cache.host.device_pool
    for layer in range(LAYERS):
        for slot, token in zip(slots.tolist(), more, strict=True):
            dev.k[layer][slot] = float(100 * token + layer)
            dev.v[layer][slot] = float(-100 * token - layer)
    assert cache.insert(prefix + more, torch.cat([held, slots])) == len(prefix)


def test_host_tokens_adds_up_a_path_of_several_nodes() -> None:
    cache = make(None, device=32)
    put(cache, [1, 2])
    extend(cache, [1, 2], [3, 4])
    extend(cache, [1, 2, 3, 4], [5, 6])
    extend(cache, [1, 2, 3, 4, 5, 6], [7, 8])
    for end in (8, 6, 4):  # the leaves, deepest first
        node = cache._walk([1, 2, 3, 4, 5, 6, 7, 8][:end], None)[0][-1]
        assert node.key == [end - 1, end] and cache._backup(node)
        assert cache.evict(2) == 2 and node.value is None
    pf = prefetch(cache, reserve=100)  # no room: nothing loads
    pf.admit(req("all", [1, 2, 3, 4, 5, 6, 7, 8, 9]), False)
    pf.admit(req("part", [1, 2, 3, 4, 5, 6, 9]), False)  # the whole key matched, more below
    pf.admit(req("stop", [1, 2, 3, 4, 9, 9, 9]), False)
    pf.poll()
    assert [pf._host_tokens(pf.queued[r]) for r in ("all", "part", "stop")] == [6, 4, 2]


def test_a_load_keeps_the_device_prefix_it_extends() -> None:
    cache = make(None, device=16)
    put(cache, [1, 2])
    extend(cache, [1, 2], [3, 4])
    child = cache._walk([1, 2, 3, 4], None)[0][-1]
    assert cache._backup(child) and cache.evict(2) == 2 and child.value is None
    put(cache, [7, 8])  # newer than [1, 2]
    assert cache.allocator.alloc(cache.allocator.available()) is not None  # no free slot
    pf = prefetch(cache)  # room: 0 free + 4 evictable - 1 = 3
    pf.admit(req("a", [1, 2, 3, 4, 9]), False)
    pf.poll()
    assert child.value is not None and host_node(cache, [1, 2]).value is not None
    assert host_node(cache, [7, 8]).value is None  # evicted instead of the locked prefix
    cache.check_tiers()


@pytest.mark.parametrize(("room", "looked_at"), [(-1, False), (0, False), (1, True)])
def test_load_ahead_looks_at_entries_only_with_room(room: int, looked_at: bool) -> None:
    cache = make(None, device=16)
    pf = prefetch(cache, reserve=13 - room)  # room: 14 - reserve - 1
    pf.admit(req("a", [5, 6, 7]), False)  # nothing cached: nothing to load
    pf.poll()
    assert pf.queued["a"].loaded is looked_at


def test_load_ahead_goes_on_past_an_entry_that_does_not_fit() -> None:
    cache = make(None, device=16)
    _on_host(cache, [1, 2, 3, 4])
    _on_host(cache, [5, 6])
    pf = prefetch(cache, reserve=10)  # room: 3
    pf.admit(req("big", [1, 2, 3, 4, 9]), False)
    pf.admit(req("small", [5, 6, 9]), False)
    pf.poll()
    assert not pf.queued["big"].loaded and pf.queued["small"].loaded
    assert host_node(cache, [5, 6]).value is not None
    assert host_node(cache, [1, 2, 3, 4]).value is None


def test_a_partial_match_of_a_host_node_loads_nothing_ahead() -> None:
    cache = make(None, device=16)
    _on_host(cache, [1, 2, 3, 4])
    pf = prefetch(cache, reserve=12)  # room: 1
    pf.admit(req("split", [1, 2, 9, 9, 9]), False)  # left to admission (it splits the node)
    pf.admit(req("none", [8, 8, 8]), False)
    pf.poll()
    assert pf.queued["split"].loaded and pf.queued["none"].loaded
    assert host_node(cache, [1, 2]).value is None


def test_the_worker_goes_on_after_a_read_that_stopped() -> None:
    store = stored(A)
    keys = page_keys(A, P, "m", None, 4)
    store.missing.add(keys[1])
    cache = make(store)
    pf = prefetch(cache)
    first = req("a", A + [9])
    pf.admit(first, False)
    assert len(done(pf, first).pages) == 1  # stopped at a missing page
    store.missing.clear()
    store.fail_get.add(keys[2])
    second = req("b", A + [9])
    pf.admit(second, False)
    assert len(done(pf, second).pages) == 2  # stopped at a failed get
    store.fail_get.clear()
    third = req("c", A + [9])
    pf.admit(third, False)
    assert len(done(pf, third).pages) == 4
    pf.close()


def test_pages_are_read_in_the_host_pools_dtype() -> None:
    store = Storage()
    writer = HiRadixCache(
        TokenAllocator(64, P), ReqToTokenPool(2, 64),
        HostKVPool(KVPool(64, LAYERS, HEADS, HEAD_DIM, torch.float16, "cpu"), 128, P,
                   "layer_first", "direct"),
        "write_back", GuardedStorage(store, "mem"), "m",
    )  # fmt: skip
    put(writer, A)
    writer.evict(8)
    dev = KVPool(32, LAYERS, HEADS, HEAD_DIM, torch.float16, "cpu")
    cache = HiRadixCache(
        TokenAllocator(32, P), ReqToTokenPool(2, 64),
        HostKVPool(dev, 64, P, "layer_first", "direct"), "write_back",
        GuardedStorage(store, "mem"), "m",
    )  # fmt: skip
    pf = prefetch(cache)
    r = req("a", A + [9])
    pf.admit(r, False)
    read = done(pf, r)
    assert [p.dtype for p in read.pages] == [torch.float16] * 4
    pf.close()


def test_a_held_prefix_under_an_extra_key() -> None:
    store = stored(A, "lora")
    cache = make(store)
    put(cache, [1, 2], "lora")
    pf = prefetch(cache, prefetch_timeout_base=0.0, prefetch_timeout_per_ki_token=1024.0)
    r = req("a", A + [9], "lora")
    before = time.monotonic()
    pf.admit(r, False)
    read = done(pf, r)
    assert read.first == 1 and store.gets == page_keys(A, P, "m", "lora", 4)[1:]
    assert before + 6.0 <= read.deadline <= time.monotonic() + 6.0  # 6 tokens to read
    pf.poll()
    first = host_node(cache, [1, 2], "lora")
    [node] = first.children.values()
    assert node.key == [3, 4, 5, 6, 7, 8]
    assert cache._root(None).children == {}
    pf.close()


def test_landing_leaves_a_held_prefix_held_and_counts_every_landing() -> None:
    store = stored(A)
    cache = make(store)
    _on_host(cache, [20, 21])  # an older host node
    put(cache, [1, 2])
    first = host_node(cache, [1, 2])
    first.host_ref = 1  # a match is loading it
    pf = prefetch(cache, reserve=100)  # no device room: what lands stays on the host
    r = req("a", A + [9])
    pf.admit(r, False)
    done(pf, r)
    pf.poll()
    assert first.host_ref == 1
    [node] = first.children.values()
    assert node.last_access > host_node(cache, [20, 21]).last_access  # LRU-fresh
    cache._evict_host(2)  # the oldest host leaf goes first
    assert cache._child_key([20]) not in cache._root(None).children
    assert node.host_value is not None
    first.host_ref = 0
    other = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], "x")
    store_x = stored([1, 2, 3, 4], "x")
    store.pages.update(store_x.pages)
    pf.admit(other, False)
    done(pf, other)
    pf.poll()
    assert cache.stats.prefetch_storage_tokens == 6 + 4


def test_every_cancelled_read_is_counted() -> None:
    cache, store, pf, r = _held("wait_complete")
    other = req("b", A + [9])
    pf.admit(other, False)
    r.finish(FinishReason("abort"))
    other.finish(FinishReason("abort"))
    pf.ended([r, other])
    assert cache.stats.prefetch_cancelled == 2
    store.gate.set()  # type: ignore[union-attr]
    pf.close()


def test_a_load_never_evicts_the_device_prefix_it_extends() -> None:
    cache = make(None, device=16)
    put(cache, [1, 2, 3, 4])
    extend(cache, [1, 2, 3, 4], [5, 6])
    child = cache._walk([1, 2, 3, 4, 5, 6], None)[0][-1]
    assert cache._backup(child) and cache.evict(2) == 2 and child.value is None
    assert cache.allocator.alloc(cache.allocator.available()) is not None  # no free slot
    pf = prefetch(cache)  # room: 0 free + 4 evictable - 1 = 3, all of it the prefix
    pf.admit(req("a", [1, 2, 3, 4, 5, 6, 9]), False)
    pf.poll()
    assert host_node(cache, [1, 2, 3, 4]).value is not None and child.value is None
    assert cache.stats.prefetch_device_tokens == 0
    cache.check_tiers()


def test_load_ahead_goes_on_past_a_host_path_that_a_split_makes_longer() -> None:
    cache = make(None, device=16)
    put(cache, [1, 2])
    extend(cache, [1, 2], [3, 4, 5, 6])
    for end in (6, 2):
        node = cache._walk([1, 2, 3, 4, 5, 6][:end], None)[0][-1]
        assert cache._backup(node)
        assert cache.evict(len(node.key)) == len(node.key) and node.value is None
    pf = prefetch(cache, reserve=10)  # room: 14 - 10 - 1 = 3
    pf.admit(req("split", [1, 2, 3, 4, 9]), False)  # counted 2; the split makes [1, 2] + [3, 4]
    pf.admit(req("none", [8, 8, 8]), False)
    pf.poll()
    assert pf.queued["split"].loaded and pf.queued["none"].loaded
    assert host_node(cache, [1, 2]).value is None
    assert cache.stats.prefetch_device_tokens == 0
