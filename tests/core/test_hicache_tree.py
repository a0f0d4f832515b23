"""core/hicache.py's HiRadixCache alone, engine-free: a real CPU device pool, host pool and
an in-memory storage backend. Each slot's KV is a fingerprint of its token, so a prefix
demoted, dropped to storage and loaded back is checked by its KV, not only by its slots
(milliseconds a test; test_hicache.py runs the cache in the engine with the tiny Llama)."""

from __future__ import annotations

import pytest
import torch
from kv_fingerprints import kv_tokens, write_fingerprints

from radixserve.core.hicache import HiCacheStats, HiRadixCache, HiTreeNode
from radixserve.core.hicache_pool import HostKVPool
from radixserve.core.hicache_storage import GuardedStorage, HiCacheStorage, page_keys
from radixserve.core.memory import KVPool, ReqToTokenPool, TokenAllocator
from radixserve.core.request import Req, SamplingParams

LAYERS, HEADS, HEAD_DIM = 2, 1, 2


class DictStorage(HiCacheStorage):
    """Pages in a dict; ``fail_set`` / ``fail_get``: keys whose set / get fails."""

    def __init__(self) -> None:
        self.pages: dict[str, torch.Tensor] = {}
        self.fail_set: set[str] = set()
        self.fail_get: set[str] = set()
        self.sets: list[str] = []
        self.closed = False
        self.broken = False  # every call raises

    def exists(self, key: str) -> bool:
        if self.broken:
            raise OSError("broken")
        return key in self.pages

    def get(self, key: str, out: torch.Tensor) -> bool:
        page = self.pages.get(key)
        if key in self.fail_get or page is None:
            return False
        if (page.shape, page.dtype) != (out.shape, out.dtype):
            return False  # another size: a miss, as the file backend does
        out.copy_(page)
        return True

    def set(self, key: str, value: torch.Tensor) -> bool:
        self.sets.append(key)
        if key in self.fail_set:
            return False
        self.pages[key] = value.clone()
        return True

    def clear(self) -> None:
        self.pages.clear()

    def close(self) -> None:
        self.closed = True


def make(
    policy: str = "write_through",
    page: int = 1,
    device: int = 16,
    host: int = 32,
    storage: DictStorage | None = None,
    namespace: str = "m",
    dtype: torch.dtype = torch.float32,
) -> HiRadixCache:
    dev = KVPool(device, LAYERS, HEADS, HEAD_DIM, dtype, "cpu")
    host_pool = HostKVPool(dev, host, page, "layer_first", "direct")
    guarded = GuardedStorage(storage, "dict") if storage is not None else None
    return HiRadixCache(
        TokenAllocator(device, page), ReqToTokenPool(2, 64), host_pool, policy, guarded, namespace
    )


def put(cache: HiRadixCache, tokens: list[int], extra_key: str | None = None) -> torch.Tensor:
    """Fresh device slots holding ``tokens``' fingerprints, inserted; the slots."""
    slots = put_new(cache, tokens)
    assert cache.insert(tokens, slots, extra_key) == 0
    return slots


def put_new(cache: HiRadixCache, tokens: list[int]) -> torch.Tensor:
    """Fresh device slots holding ``tokens``' fingerprints (not inserted)."""
    slots = cache.allocator.alloc(len(tokens))
    assert slots is not None
    write_fingerprints(cache, slots, tokens)
    return slots


def node_of(cache: HiRadixCache, tokens: list[int], extra_key: str | None = None) -> HiTreeNode:
    node = cache._root(extra_key).children[cache._child_key(tokens)]
    assert isinstance(node, HiTreeNode)
    return node


def wipe(cache: HiRadixCache) -> None:
    """Scribble over every device slot, so what a load brings back is the host's copy."""
    dev = cache.host.device_pool
    for layer in range(LAYERS):
        dev.k[layer].fill_(-1.0)
        dev.v[layer].fill_(-1.0)


def test_write_through_copies_at_insert_and_demotes_on_eviction() -> None:
    cache = make()
    a = [1, 2, 3, 4]
    put(cache, a)
    node = node_of(cache, a)
    assert node.host_value is not None and len(node.host_value) == 4  # copied at once
    assert cache.host_accounting() == {"size": 32, "free": 28, "held": 4}
    assert cache.evict(1) == 4
    assert node.value is None and node.host_value is not None
    assert cache.allocator.available() == 16 and cache.evictable_size == 0
    assert cache.stats.demoted_tokens == 4 and cache.stats.dropped_tokens == 0
    cache.check_tiers()
    wipe(cache)
    match = cache.match_prefix(a + [9])
    assert kv_tokens(cache, match.kv_indices) == a
    assert match.last_node is node and node.value is not None
    assert cache.stats.host_hit_tokens == 4 and cache.stats.device_hit_tokens == 0
    assert cache.evictable_size == 4 and cache.allocator.available() == 12
    cache.check_tiers()
    again = cache.match_prefix(a)
    assert again.kv_indices.tolist() == match.kv_indices.tolist()
    assert cache.stats.device_hit_tokens == 4 and cache.stats.host_hit_tokens == 4
    cache.match_prefix(a)
    assert cache.stats.device_hit_tokens == 8  # counts add up
    assert cache.evict(4) == 4 and cache.stats.demoted_tokens == 8
    cache.match_prefix(a)
    assert cache.stats.host_hit_tokens == 8


def test_write_back_copies_only_when_evicted() -> None:
    cache = make("write_back")
    put(cache, [1, 2, 3])
    node = node_of(cache, [1, 2, 3])
    assert node.host_value is None and cache.host_accounting()["held"] == 0
    assert cache._backup(node) is True and node.host_value is not None
    cache.host.allocator.free(node.host_value)
    node.host_value = None
    assert cache.evict(3) == 3
    assert node.value is None and node.host_value is not None
    assert cache.stats.demoted_tokens == 3
    wipe(cache)
    assert kv_tokens(cache, cache.match_prefix([1, 2, 3]).kv_indices) == [1, 2, 3]
    cache.check_tiers()


def test_selective_policy_backs_up_on_the_second_hit_and_drops_cold_nodes() -> None:
    cache = make("write_through_selective")
    put(cache, [1, 2])
    put(cache, [5, 6, 7])
    hot, cold = node_of(cache, [1, 2]), node_of(cache, [5, 6, 7])
    cache.match_prefix([1, 2])
    assert hot.hit_count == 1 and hot.host_value is None
    cache.match_prefix([1, 2])
    assert hot.hit_count == 2 and hot.host_value is not None
    assert cold.host_value is None
    assert cache.evict(100) == 5  # all the tree holds (never the root)
    assert hot.value is None and hot.host_value is not None  # demoted
    assert cache._child_key([5]) not in cache._root(None).children  # dropped
    assert cache.stats.dropped_tokens == 3 and cache.stats.demoted_tokens == 2
    assert cache.allocator.available() == 16
    put(cache, [8])
    assert cache.evict(1) == 1 and cache.stats.dropped_tokens == 4
    cache.check_tiers()


def test_eviction_takes_lru_device_leaves_then_their_parents() -> None:
    cache = make()
    put(cache, [1, 2])
    extend(cache, [1, 2], [3, 4])
    put(cache, [7, 8])
    parent, other = node_of(cache, [1, 2]), node_of(cache, [7, 8])
    child = parent.children[cache._child_key([3])]
    cache.match_prefix([7, 8])  # the most recent
    assert cache.evict(3) == 4  # the child (2), then its parent (2): both older than [7, 8]
    assert child.value is None and parent.value is None and other.value is not None
    cache.check_tiers()
    locked = make()
    put(locked, [1, 2])
    locked.inc_lock_ref(node_of(locked, [1, 2]))
    assert locked.evict(2) == 0
    assert node_of(locked, [1, 2]).value is not None


def extend(cache: HiRadixCache, prefix: list[int], more: list[int]) -> None:
    """Insert ``prefix + more`` where ``prefix`` is cached: a child node under it."""
    kv = torch.cat([cache.match_prefix(prefix).kv_indices, put_new(cache, more)])
    assert cache.insert(prefix + more, kv) == len(prefix)


def test_a_load_that_does_not_fit_keeps_the_device_part_matched() -> None:
    cache = make(device=8, host=32)
    put(cache, [1, 2, 3, 4, 5, 6])
    assert cache.evict(6) == 6
    base = put(cache, [9, 9, 9])  # [9]: 3 tokens on the device
    cache.insert([9, 9, 9, 8, 8], torch.cat([base, put_new(cache, [8, 8])]))
    # 5 device slots taken by [9, 9, 9, 8, 8]; evict the tail so only [9, 9, 9] stays on device
    tail = node_of(cache, [9]).children[cache._child_key([8])]
    assert isinstance(tail, HiTreeNode)
    cache.match_prefix([9, 9, 9])  # the head is more recent than the tail
    assert cache.evict(1) == 2 and tail.value is None
    node = node_of(cache, [1])
    # [1..6] needs 6 device slots: 5 free; eviction may not take the matched [9, 9, 9]
    head = node_of(cache, [9])
    cache.inc_lock_ref(head)
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.kv_indices.numel() == 0 and node.value is None
    assert node.host_ref == 0 and head.value is not None
    cache.dec_lock_ref(head)
    # a match through the device head into the host tail: the head is locked meanwhile
    wipe_keep = cache.match_prefix([9, 9, 9, 8, 8])
    assert len(wipe_keep.kv_indices) == 5 and tail.value is not None
    assert head.lock_ref == 0 and tail.host_ref == 0
    cache.check_tiers()


def test_host_eviction_drops_lru_host_leaves_for_new_copies() -> None:
    cache = make(device=16, host=6)
    put(cache, [1, 2, 3])
    assert cache.evict(3) == 3
    put(cache, [4, 5, 6])  # the host pool is full now
    assert cache.host_accounting() == {"size": 6, "free": 0, "held": 6}
    dropped = node_of(cache, [1, 2, 3])
    put(cache, [7, 8])  # its copy evicts the host-only [1, 2, 3]
    assert dropped.host_value is None
    assert cache._child_key([1]) not in cache._root(None).children
    assert cache.stats.host_evicted_tokens == 3
    assert node_of(cache, [7, 8]).host_value is not None
    assert cache.host_accounting() == {"size": 6, "free": 1, "held": 5}
    cache.check_tiers()


def test_host_eviction_walks_up_to_host_only_parents() -> None:
    cache = make(device=16, host=4)
    put(cache, [1, 2])
    extend(cache, [1, 2], [3, 4])
    assert cache.evict(4) == 4  # both host-only now, 4 host slots held
    assert cache._alloc_host(4) is not None  # the leaf, then its parent
    assert cache._root(None).children == {}
    assert cache.stats.host_evicted_tokens == 4


def test_host_full_of_held_nodes_means_no_copy() -> None:
    cache = make(device=16, host=2)
    put(cache, [1, 2])
    node = node_of(cache, [1, 2])
    assert node.host_value is not None
    put(cache, [3, 4, 5])  # no room, nothing host-only to evict
    assert node_of(cache, [3]).host_value is None
    assert cache._backup(node_of(cache, [3])) is False
    assert cache.evict(2) == 2  # the LRU [1, 2] is demoted
    assert node.value is None and node.host_value is not None
    # [3, 4, 5] has no copy: evicting it tries one first, which drops the host-only [1, 2]
    # (and still finds no room for 3 tokens), then drops the node itself
    assert cache.evict(1) == 3
    assert cache.stats.dropped_tokens == 3 and cache.stats.host_evicted_tokens == 2
    assert cache._root(None).children == {} and cache.host_accounting()["free"] == 2
    cache.check_tiers()


def test_split_carries_both_tiers_and_counters() -> None:
    cache = make()
    slots = put(cache, [1, 2, 3, 4])
    node = node_of(cache, [1, 2, 3, 4])
    node.hit_count = 3
    node.stored = True
    host = node.host_value
    assert host is not None
    match = cache.match_prefix([1, 2, 9])
    upper = match.last_node
    assert isinstance(upper, HiTreeNode) and upper is not node
    assert upper.key == [1, 2] and node.key == [3, 4]
    assert upper.value is not None and upper.value.tolist() == slots[:2].tolist()
    assert node.value is not None and node.value.tolist() == slots[2:].tolist()
    assert upper.host_value is not None and upper.host_value.tolist() == host[:2].tolist()
    assert node.host_value is not None and node.host_value.tolist() == host[2:].tolist()
    assert upper.hit_count == 4 and upper.stored and node.parent is upper
    assert upper.children == {cache._child_key([3]): node}
    # a split of a host-only node keeps both halves off the device
    assert cache.evict(4) == 4
    cache._split(node, 1)
    lower = node_of(cache, [1]).children[cache._child_key([3])]
    assert lower.value is None and lower.children[cache._child_key([4])].value is None
    cache.check_tiers()


def test_storage_keeps_pages_host_eviction_drops_and_a_new_cache_finds_them() -> None:
    store = DictStorage()
    cache = make("write_back", page=2, device=16, host=8, storage=store)
    a = [1, 2, 3, 4, 5, 6]
    put(cache, a)
    assert store.pages == {}  # write_back: nothing copied yet
    assert cache.evict(6) == 6
    assert len(store.pages) == 3 and cache.stats.storage_written_pages == 3
    assert set(store.pages) == set(page_keys(a, 2, "m", None, 3))
    page = store.pages[page_keys(a, 2, "m", None, 1)[0]]
    assert page.shape == (2, LAYERS, 2, HEADS, HEAD_DIM)
    assert page[1, 1, 0].tolist() == [[201.0] * HEAD_DIM]  # token 2, layer 1, K
    # a restarted cache over the same storage: the prefix's pages come back through the host
    fresh = make("write_back", page=2, device=16, host=8, storage=store)
    match = fresh.match_prefix(a + [7])
    assert kv_tokens(fresh, match.kv_indices) == a
    assert fresh.stats.storage_hit_tokens == 6 and fresh.stats.host_hit_tokens == 0
    node = node_of(fresh, a)
    assert node.stored and node.host_value is not None and node.value is not None
    fresh.check_tiers()
    # another namespace or extra key: other page keys, a miss
    other = make("write_back", page=2, storage=store, namespace="n")
    assert other.match_prefix(a).kv_indices.numel() == 0
    assert fresh.match_prefix(a, "salt").kv_indices.numel() == 0
    # a stored node is not written again
    sets = len(store.sets)
    fresh.evict(6)
    fresh._evict_host(8)
    assert len(store.sets) == sets
    fresh.match_prefix(a)  # from storage again: the hits add up
    assert fresh.stats.storage_hit_tokens == 12


def test_storage_extends_a_device_match_and_stops_at_the_first_missing_page() -> None:
    store = DictStorage()
    writer = make("write_through", page=2, storage=store)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    put(writer, a)
    assert len(store.pages) == 4  # write_through with storage: written at insert
    keys = page_keys(a, 2, "m", None, 4)
    del store.pages[keys[3]]
    store.fail_get.add(keys[2])
    reader = make("write_through", page=2, storage=store)
    put(reader, [1, 2])
    match = reader.match_prefix(a)
    # [1, 2] on the device, then storage pages 1 (found) and 2 (found, but its get fails)
    assert kv_tokens(reader, match.kv_indices) == [1, 2, 3, 4]
    assert reader.stats.storage_hit_tokens == 2 and reader.stats.device_hit_tokens == 2
    assert reader.host_accounting()["held"] == 4  # [1, 2]'s copy and page 1; page 2's slots freed
    reader.check_tiers()
    # the key up to a page boundary only
    assert reader.match_prefix([1, 2, 3]).kv_indices.numel() == 2
    # sync_storage off: storage is not read on the engine thread
    off = make("write_through", page=2, storage=store)
    off.sync_storage = False
    assert off.match_prefix(a).kv_indices.numel() == 0
    # the host pool cannot hold what storage has: a miss
    small = make("write_through", page=2, host=4, storage=store)  # one host page
    assert small.match_prefix(a).kv_indices.numel() == 0
    assert small.host_accounting() == {"size": 2, "free": 2, "held": 0}


def test_a_failed_store_stops_there_and_is_tried_again() -> None:
    store = DictStorage()
    cache = make("write_back", page=2, host=6, storage=store)
    a = [1, 2, 3, 4]
    keys = page_keys(a, 2, "m", None, 2)
    store.fail_set.add(keys[0])
    put(cache, a)
    assert cache.evict(4) == 4  # copied to the host, its first page not to storage
    node = node_of(cache, a)
    assert store.sets == [keys[0]] and not node.stored and store.pages == {}
    store.fail_set.clear()
    store.pages[keys[0]] = torch.zeros(2, LAYERS, 2, HEADS, HEAD_DIM)  # already there: skipped
    cache._store(node)
    assert store.sets == [keys[0], keys[1]] and node.stored
    assert cache.stats.storage_written_pages == 1


def test_stats_and_tier_stats() -> None:
    stats = HiCacheStats(device_hit_tokens=3)
    assert stats.to_json()["device_hit_tokens"] == 3 and len(stats.to_json()) == 10
    cache = make(storage=DictStorage())
    put(cache, [1, 2])
    tiers = cache.tier_stats()
    assert tiers is not None
    assert tiers["host_size"] == 32 and tiers["host_held"] == 2 and tiers["storage_errors"] == 0
    assert tiers["device_hit_tokens"] == 0
    assert make().tier_stats()["storage_errors"] == 0  # type: ignore[index]


def test_check_tiers_names_each_inconsistency() -> None:
    cache = make()
    put(cache, [1, 2, 3])
    cache.check_tiers()
    node = node_of(cache, [1, 2, 3])
    cache._split(node, 2)
    node = node_of(cache, [1, 2])
    cache.evictable_size += 1
    with pytest.raises(AssertionError, match="device sizes 3/0 counted 4/0"):
        cache.check_tiers()
    cache.evictable_size -= 1
    lower = node.children[cache._child_key([3])]
    cache.inc_lock_ref(lower)  # both nodes locked: 3 tokens
    assert cache.locked_size == 3
    cache.check_tiers()
    cache.dec_lock_ref(lower)
    leaked = cache.host.allocator.alloc(1)
    assert leaked is not None
    with pytest.raises(AssertionError, match="host KV leak"):
        cache.check_tiers()
    cache.host.allocator.free(leaked)
    child = node.children[cache._child_key([3])]
    value = node.value
    node.value = None
    with pytest.raises(AssertionError, match="^a device node under a node off the device$"):
        cache.check_tiers()
    node.value = value
    assert isinstance(child, HiTreeNode)
    assert child.host_value is not None
    cache.host.allocator.free(child.host_value)
    child.value, child.host_value = None, None
    with pytest.raises(AssertionError, match="^a node in no tier stayed in the tree$"):
        cache.check_tiers()


def test_flush_drops_host_copies_and_unlocked_device_nodes() -> None:
    store = DictStorage()
    cache = make(storage=store)
    put(cache, [1, 2])
    put(cache, [5, 6])
    put(cache, [8])
    extend(cache, [8], [9])
    cache.evict(1)  # [1, 2] is the LRU: host only
    held = node_of(cache, [5, 6])
    cache.inc_lock_ref(held)
    cache.flush()
    root = cache._root(None)
    assert list(root.children.values()) == [held]
    assert held.host_value is None and not held.stored and held.value is not None
    assert cache.host_accounting()["free"] == 32 and cache.allocator.available() == 14
    assert store.pages  # storage stays
    cache.check_tiers()


def test_clear_storage_and_close() -> None:
    assert make().clear_storage() is False
    make().close()  # no storage: nothing to close
    store = DictStorage()
    cache = make(storage=store)
    put(cache, [1, 2])
    node = node_of(cache, [1, 2])
    assert node.stored and store.pages
    assert cache.clear_storage() is True
    assert store.pages == {} and not node.stored
    cache.close()
    assert store.closed


def test_a_requests_own_rematch_is_no_hit() -> None:
    cache = make()
    req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=1))
    req.req_pool_idx = cache.req_to_token.alloc()
    slots = put_new(cache, [1, 2, 3])
    cache.req_to_token.write(req.req_pool_idx, 0, slots)
    req.kv_len = 3
    cache.cache_unfinished_req(req)
    assert cache.stats.device_hit_tokens == 0 and cache._counting
    assert req.prefix_len == 3
    cache.match_prefix([1, 2, 3])
    assert cache.stats.device_hit_tokens == 3


def test_extra_keys_have_their_own_roots_in_storage() -> None:
    store = DictStorage()
    cache = make("write_through", page=2, storage=store)
    put(cache, [1, 2], "lora")
    assert set(store.pages) == set(page_keys([1, 2], 2, "m", "lora", 1))
    assert cache._extra_key_of(node_of(cache, [1, 2], "lora")) == "lora"


def test_device_eviction_takes_a_child_before_its_parent() -> None:
    cache = make()
    put(cache, [1, 2])
    extend(cache, [1, 2], [3, 4])
    parent = node_of(cache, [1, 2])
    child = parent.children[cache._child_key([3])]
    assert cache.evict(1) == 2  # the leaf only
    assert child.value is None and parent.value is not None
    cache.check_tiers()
    assert cache.evict(1) == 2  # a parent whose children are off the device is a leaf now
    assert parent.value is None
    cache.check_tiers()


def test_host_eviction_frees_just_enough_lru_leaves() -> None:
    cache = make(host=4)
    for token in (1, 2, 3):
        put(cache, [token])
    assert cache.evict(3) == 3  # three one-token host-only leaves, one host slot free
    slots = cache._alloc_host(3)
    assert slots is not None and len(slots) == 3
    assert sorted(cache._root(None).children) == [3]  # the two oldest went, [3] stays
    assert cache.stats.host_evicted_tokens == 2
    cache.host.allocator.free(slots)
    cache.check_tiers()


def test_a_load_evicts_just_enough_device_leaves() -> None:
    cache = make(device=8)
    put(cache, [1, 2, 3, 4])
    assert cache.evict(4) == 4
    put(cache, [5, 6, 7])
    put(cache, [8, 9, 10])  # 2 device slots free; [1..4] needs 4
    wipe(cache)
    assert kv_tokens(cache, cache.match_prefix([1, 2, 3, 4]).kv_indices) == [1, 2, 3, 4]
    assert node_of(cache, [5]).value is None  # the LRU leaf made room
    assert node_of(cache, [8]).value is not None  # and no more
    cache.check_tiers()


def test_a_load_keeps_the_matched_device_part_locked() -> None:
    store = DictStorage()
    put(make("write_through", page=2, storage=store), [1, 2, 3, 4, 5, 6, 7, 8])
    cache = make("write_through", page=2, device=8, storage=store)  # 3 device pages
    put(cache, [1, 2])
    put(cache, [9, 9])  # one page free; storage's [3..8] needs three
    head = node_of(cache, [1, 2])
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    # evicting [9, 9] is not enough, and the matched [1, 2] may not go
    assert head.value is not None and match.kv_indices.tolist() == head.value.tolist()
    assert match.last_node is head and head.lock_ref == 0
    assert node_of(cache, [9, 9]).value is None
    cache.check_tiers()


def test_a_three_node_host_path_loads_in_order() -> None:
    cache = make()
    put(cache, [1, 2])
    extend(cache, [1, 2], [3, 4])
    extend(cache, [1, 2, 3, 4], [5, 6])
    assert cache.evict(6) == 6
    wipe(cache)
    assert kv_tokens(cache, cache.match_prefix([1, 2, 3, 4, 5, 6]).kv_indices) == [1, 2, 3, 4, 5, 6]
    cache.check_tiers()


def test_an_insert_over_a_host_only_node_takes_the_callers_slots() -> None:
    cache = make()
    put(cache, [1, 2, 3])
    assert cache.evict(3) == 3
    put(cache, [9])
    node = node_of(cache, [1, 2, 3])
    slots = put_new(cache, [1, 2, 3, 4, 5])
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0  # nothing counts as already cached
    assert node.value is not None and node.value.tolist() == slots[:3].tolist()
    assert cache.evictable_size == 6
    assert cache.match_prefix([1, 2, 3, 4, 5]).kv_indices.tolist() == slots.tolist()
    cache.check_tiers()


def test_a_child_node_stores_only_its_own_pages_keyed_by_the_whole_path() -> None:
    store = DictStorage()
    cache = make("write_back", page=2, storage=store)
    put(cache, [1, 2])
    extend(cache, [1, 2], [3, 4])
    assert cache.evict(1) == 2  # the child, backed up and stored; the parent stays
    keys = page_keys([1, 2, 3, 4], 2, "m", None, 2)
    assert list(store.pages) == [keys[1]]
    assert store.pages[keys[1]][:, 0, 0].flatten().tolist() == [300.0, 300.0, 400.0, 400.0]


def test_a_stored_node_is_not_written_again() -> None:
    store = DictStorage()
    cache = make("write_through", page=2, storage=store)
    put(cache, [1, 2])
    assert len(store.sets) == 1
    store.pages.clear()  # the backend lost it: the node still counts as stored
    cache.evict(2)
    cache._evict_host(2)
    assert len(store.sets) == 1


def test_storage_is_read_for_a_single_page_and_under_the_extra_key() -> None:
    store = DictStorage()
    writer = make("write_through", page=2, storage=store)
    put(writer, [1, 2, 3, 4], "lora")
    reader = make("write_through", page=2, storage=store)
    assert reader.match_prefix([1, 2, 3, 4]).kv_indices.numel() == 0  # another root
    miss = reader.match_prefix([1, 2, 3, 4], "other")
    assert miss.last_node is reader._root("other")
    put(reader, [7, 7])
    put(reader, [1, 2], "lora")
    match = reader.match_prefix([1, 2, 3, 4], "lora")  # one page past the device part
    assert kv_tokens(reader, match.kv_indices) == [1, 2, 3, 4]
    fetched = match.last_node
    assert isinstance(fetched, HiTreeNode) and fetched.parent is node_of(reader, [1, 2], "lora")
    assert reader.stats.storage_hit_tokens == 2
    assert reader.evict(2) == 2  # the fetched node is the most recent: [7, 7] goes first
    assert node_of(reader, [7, 7]).value is None and fetched.value is not None
    fresh = make("write_through", page=2, storage=store)
    first = fresh.match_prefix([1, 2, 3, 4], "lora")  # from the root of "lora"
    assert first.last_node.parent is fresh._root("lora") and len(first.kv_indices) == 4
    assert fresh.match_prefix([1, 2, 3, 4], "lora").kv_indices.numel() == 4
    assert fresh.stats.storage_hit_tokens == 4 and fresh.stats.device_hit_tokens == 4
    put(fresh, [7, 7])
    assert fresh.evict(100) == 6  # the fetched node is in the LRU order like any other
    fresh.check_tiers()


def test_a_storage_miss_evicts_nothing_from_the_host() -> None:
    store = DictStorage()
    cache = make("write_through", page=2, host=3, storage=store)  # one host page
    put(cache, [1, 2])
    assert cache.evict(2) == 2  # host-only, the host pool full
    node = node_of(cache, [1, 2])
    assert cache.match_prefix([5, 6, 7, 8]).kv_indices.numel() == 0
    assert node.host_value is not None


def test_a_fetch_protects_the_host_path_it_extends() -> None:
    store = DictStorage()
    put(make("write_through", page=2, storage=store), [1, 2, 3, 4])
    cache = make("write_through", page=2, host=3, storage=store)  # one host page
    put(cache, [1, 2])
    assert cache.evict(2) == 2
    node = node_of(cache, [1, 2])
    # storage holds [3, 4] but the host pool is full with [1, 2], which this match needs
    match = cache.match_prefix([1, 2, 3, 4])
    assert kv_tokens(cache, match.kv_indices) == [1, 2] and match.last_node is node
    assert node.host_ref == 0 and node.host_value is not None
    cache.check_tiers()
    assert cache.evict(2) == 2 and cache._alloc_host(2) is not None  # evictable again


def test_storage_pages_of_another_dtype() -> None:
    store = DictStorage()
    cache = make("write_through", page=2, storage=store, dtype=torch.float16)
    put(cache, [1, 2])
    assert store.pages[page_keys([1, 2], 2, "m", None, 1)[0]].dtype == torch.float16
    fresh = make("write_through", page=2, storage=store, dtype=torch.float16)
    assert kv_tokens(fresh, fresh.match_prefix([1, 2]).kv_indices) == [1, 2]


def test_the_default_namespace_and_storage_errors() -> None:
    store = DictStorage()
    dev = KVPool(8, LAYERS, HEADS, HEAD_DIM, torch.float32, "cpu")
    host = HostKVPool(dev, 8, 1, "layer_first", "direct")
    cache = HiRadixCache(
        TokenAllocator(8, 1),
        ReqToTokenPool(1, 8),
        host,
        "write_through",
        GuardedStorage(store, "d"),
    )
    put(cache, [4])
    assert list(store.pages) == page_keys([4], 1, "", None, 1)
    store.broken = True
    assert cache.match_prefix([5]).kv_indices.numel() == 0
    stats = cache.tier_stats()
    assert stats is not None and stats["storage_errors"] == 1
