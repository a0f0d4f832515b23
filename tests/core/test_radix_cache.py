"""RadixCache: match/insert/split/lock/evict, namespaces, request integration, page-aligned
matching with pages of 16 tokens, and a property-based model check against a naive reference
(a dict of cached prefixes) for page sizes 1 and 16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.core.radix_cache import NoPrefixCache, RadixCache, TreeNode, _common_prefix_len
from radixserve.core.request import Req, SamplingParams


class TrackingAllocator(TokenAllocator):
    """A TokenAllocator that keeps the free set (of slots of free pages) in Python and fails
    loudly on a double free, a free of a page never handed out or not from a page boundary, or
    the reserved page 0."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        super().__init__(size, page_size)
        self.free_set = set(range(page_size, self.size + page_size))
        self.freed_log: list[int] = []

    def _page_slots_of(self, slots: list[int]) -> set[int]:
        p = self.page_size
        return {page * p + i for page in {s // p for s in slots} for i in range(p)}

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        out = super().alloc(num_tokens)
        if out is not None:
            slots = out.tolist()
            assert len(set(slots)) == len(slots), f"duplicate slots handed out: {slots}"
            assert min(slots, default=1) >= self.page_size, "the reserved page 0 was handed out"
            taken = self._page_slots_of(slots)
            assert taken <= self.free_set, f"handed out slots that are in use: {slots}"
            self.free_set -= taken
        return out

    def free(self, slots: torch.Tensor) -> None:
        values = slots.tolist()
        assert len(set(values)) == len(values), f"freeing the same slot twice at once: {values}"
        assert not values or values[0] % self.page_size == 0, f"free mid-page: {values}"
        pages = self._page_slots_of(values)
        for s in pages:
            assert self.page_size <= s < self.size + self.page_size, f"freeing {s}, never used"
            assert s not in self.free_set, f"double free of slot {s}"
        self.free_set |= pages
        self.freed_log += values
        super().free(slots)


def make_cache(size: int = 64, page_size: int = 1) -> tuple[RadixCache, TrackingAllocator]:
    alloc = TrackingAllocator(size, page_size)
    return RadixCache(alloc, ReqToTokenPool(4, 256)), alloc


def insert_fresh(cache: RadixCache, key: list[int], extra_key: str | None = None) -> torch.Tensor:
    """Insert ``key`` with freshly allocated slots, freeing the duplicates as callers must;
    return the slots the tree now holds for ``key``."""
    slots = cache.allocator.alloc(len(key))
    assert slots is not None
    already = cache.insert(key, slots, extra_key)
    cache.allocator.free(slots[:already])
    return cache.match_prefix(key, extra_key).kv_indices


def tree_slots(cache: RadixCache) -> list[int]:
    return [s for node in cache._all_nodes() for s in node.value.tolist()]


def assert_accounted(cache: RadixCache, alloc: TokenAllocator, held: int = 0) -> None:
    assert alloc.available() + cache.evictable_size + cache.locked_size + held == alloc.size
    assert cache.evictable_size + cache.locked_size == cache.total_size()


# -- allocator ------------------------------------------------------------------------------


def test_allocator_never_hands_out_slot_0_and_alloc_failure_changes_nothing() -> None:
    alloc = TrackingAllocator(8)
    a = alloc.alloc(5)
    assert a is not None and 0 not in a.tolist()
    assert alloc.alloc(4) is None
    assert alloc.available() == 3
    alloc.free(a[:2])
    b = alloc.alloc(5)  # needs the lazily released slots
    assert b is not None and sorted(b.tolist() + a[2:].tolist()) == list(range(1, 9))
    assert alloc.available() == 0


# -- match / insert / split -----------------------------------------------------------------


def test_match_on_empty_tree_returns_root_and_no_slots() -> None:
    cache, _ = make_cache()
    kv, node = cache.match_prefix([1, 2, 3])
    assert kv.numel() == 0 and node.parent is None


def test_insert_then_match_returns_the_inserted_slots() -> None:
    cache, alloc = make_cache()
    slots = alloc.alloc(4)
    assert slots is not None
    assert cache.insert([1, 2, 3, 4], slots) == 0
    kv, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert kv.tolist() == slots.tolist()
    assert node.key == [1, 2, 3, 4]
    assert cache.evictable_size == 4 and cache.locked_size == 0
    assert_accounted(cache, alloc)


def test_partial_match_splits_the_node_at_the_divergence() -> None:
    cache, alloc = make_cache()
    slots = insert_fresh(cache, [1, 2, 3, 4, 5])
    kv, node = cache.match_prefix([1, 2, 3, 9])
    assert kv.tolist() == slots[:3].tolist()
    assert node.key == [1, 2, 3]
    assert list(node.children) == [4] and node.children[4].key == [4, 5]
    assert node.children[4].value.tolist() == slots[3:].tolist()
    assert cache.total_size() == 5  # a split moves no tokens
    assert_accounted(cache, alloc)


def test_match_of_a_shorter_key_ends_inside_a_node() -> None:
    cache, _ = make_cache()
    slots = insert_fresh(cache, [1, 2, 3, 4])
    kv, node = cache.match_prefix([1, 2])
    assert kv.tolist() == slots[:2].tolist() and node.key == [1, 2]


def test_insert_returns_the_already_cached_length_and_keeps_the_trees_slots() -> None:
    cache, alloc = make_cache()
    first = insert_fresh(cache, [1, 2, 3, 4])
    mine = alloc.alloc(6)
    assert mine is not None
    already = cache.insert([1, 2, 3, 7, 8, 9], mine)
    assert already == 3
    alloc.free(mine[:already])
    kv, _ = cache.match_prefix([1, 2, 3, 7, 8, 9])
    assert kv.tolist() == first[:3].tolist() + mine[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 4]).kv_indices.tolist() == first.tolist()
    assert cache.total_size() == 7
    assert_accounted(cache, alloc)


def test_insert_of_a_fully_cached_key_adds_nothing() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, [1, 2, 3])
    mine = alloc.alloc(2)
    assert mine is not None
    assert cache.insert([1, 2], mine) == 2
    alloc.free(mine)
    assert cache.total_size() == 3
    assert_accounted(cache, alloc)


def test_namespaces_via_extra_key_are_disjoint() -> None:
    cache, alloc = make_cache()
    a = insert_fresh(cache, [1, 2, 3], extra_key="lora-a")
    assert cache.match_prefix([1, 2, 3]).kv_indices.numel() == 0
    assert cache.match_prefix([1, 2, 3], "lora-b").kv_indices.numel() == 0
    b = insert_fresh(cache, [1, 2, 3])
    assert set(a.tolist()).isdisjoint(b.tolist())
    assert cache.match_prefix([1, 2, 3], "lora-a").kv_indices.tolist() == a.tolist()
    assert cache.match_prefix([1, 2, 3]).kv_indices.tolist() == b.tolist()
    assert cache.total_size() == 6
    assert_accounted(cache, alloc)


# -- lock / evict ---------------------------------------------------------------------------


def test_lock_moves_tokens_from_evictable_to_locked_up_to_the_root() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    assert (cache.locked_size, cache.evictable_size) == (4, 1)
    cache.inc_lock_ref(node)  # a second user of the same prefix
    assert (cache.locked_size, cache.evictable_size) == (4, 1)
    cache.dec_lock_ref(node)
    assert (cache.locked_size, cache.evictable_size) == (4, 1)
    cache.dec_lock_ref(node)
    assert (cache.locked_size, cache.evictable_size) == (0, 5)
    assert_accounted(cache, alloc)


def test_split_of_a_locked_node_keeps_both_halves_locked() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    cache.match_prefix([1, 2, 9])  # splits the locked node
    assert node.parent is not None and node.parent.lock_ref == 1
    assert cache.evict(100) == 0
    assert cache.locked_size == 4
    cache.dec_lock_ref(node)
    assert cache.locked_size == 0 and cache.evictable_size == 4
    assert cache.evict(100) == 4
    assert_accounted(cache, alloc)


def test_evict_frees_least_recently_used_leaves_first() -> None:
    cache, alloc = make_cache()
    old = insert_fresh(cache, [1, 2])
    new = insert_fresh(cache, [3, 4])
    cache.match_prefix([1, 2])  # touch: [3, 4] is now the least recently used
    freed_before = len(alloc.freed_log)
    assert cache.evict(1) == 2
    assert sorted(alloc.freed_log[freed_before:]) == sorted(new.tolist())
    assert cache.match_prefix([3, 4]).kv_indices.numel() == 0
    assert cache.match_prefix([1, 2]).kv_indices.tolist() == old.tolist()
    assert_accounted(cache, alloc)


def test_evict_removes_leaves_before_their_parents() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 4, 5])
    cache.match_prefix([1, 2, 4, 5])  # [3] is the LRU leaf; the shared [1, 2] is inner
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 2, 4, 5]).kv_indices.numel() == 4
    assert cache.evict(3) == 4  # [4, 5] then the now-leaf [1, 2]
    assert cache.total_size() == 0 and alloc.available() == alloc.size


def test_evict_never_frees_a_locked_prefix() -> None:
    cache, alloc = make_cache()
    kept = insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 3, 4, 5])
    insert_fresh(cache, [7, 8])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    assert cache.evict(100) == 4  # the unlocked tail [4, 5] and [7, 8]
    assert cache.match_prefix([1, 2, 3, 4]).kv_indices.tolist() == kept.tolist()
    assert (cache.locked_size, cache.evictable_size) == (3, 0)
    cache.dec_lock_ref(node)
    assert_accounted(cache, alloc)


def test_no_prefix_cache_never_matches_and_frees_on_finish() -> None:
    alloc = TrackingAllocator(16)
    pool = ReqToTokenPool(2, 16)
    cache = NoPrefixCache(alloc, pool)
    req = _running_req(pool, alloc, [1, 2, 3, 4])
    cache.cache_unfinished_req(req)
    assert cache.match_prefix([1, 2, 3]).kv_indices.numel() == 0
    cache.cache_finished_req(req)
    assert alloc.available() == alloc.size and cache.evict(10) == 0


# -- request integration --------------------------------------------------------------------


def _running_req(pool: ReqToTokenPool, alloc: TokenAllocator, ids: list[int]) -> Req:
    """A request whose KV for all of ``ids`` was just computed into fresh slots."""
    req = Req("r", ids, SamplingParams())
    req.req_pool_idx = pool.alloc()
    slots = alloc.alloc(len(ids))
    assert req.req_pool_idx is not None and slots is not None
    pool.table[req.req_pool_idx, : len(ids)] = slots
    req.kv_len = len(ids)
    return req


def test_cache_unfinished_then_finished_req_shares_and_releases() -> None:
    cache, alloc = make_cache()
    pool = cache.req_to_token
    first = insert_fresh(cache, [1, 2, 3])
    # A request computed [1, 2, 3, 4, 5] itself while [1, 2, 3] was cached by someone else.
    req = _running_req(pool, alloc, [1, 2, 3, 4, 5])
    cache.cache_unfinished_req(req)
    row = pool.table[req.req_pool_idx, :5]
    assert row[:3].tolist() == first.tolist()  # switched to the tree's slots, dups freed
    assert req.prefix_len == 5 and req.cache_node is not None
    assert (cache.locked_size, cache.evictable_size) == (5, 0)
    assert_accounted(cache, alloc)
    cache.cache_finished_req(req)
    assert req.cache_node is None and req.prefix_len == 0
    assert (cache.locked_size, cache.evictable_size) == (0, 5)
    assert cache.match_prefix([1, 2, 3, 4, 5]).kv_indices.tolist() == row.tolist()
    assert_accounted(cache, alloc)


# -- page size 16 ---------------------------------------------------------------------------

P = 16


def test_paged_match_and_insert_are_whole_pages() -> None:
    cache, alloc = make_cache(20 * P - 1, P)
    key = list(range(100, 140))  # 2 pages and 8 tokens
    slots = alloc.alloc(len(key))
    assert slots is not None
    assert cache.insert(key, slots) == 0
    alloc.free(slots[2 * P :])  # the partial last page is not cached: the caller frees it
    assert cache.total_size() == cache.evictable_size == 2 * P
    assert cache.match_prefix(key).kv_indices.tolist() == slots[: 2 * P].tolist()
    assert cache.match_prefix(key[: 2 * P - 1]).kv_indices.tolist() == slots[:P].tolist()
    assert cache.match_prefix(key[: P - 1]).kv_indices.numel() == 0
    assert_accounted(cache, alloc)


def test_paged_divergence_inside_a_page_splits_at_the_page_before() -> None:
    cache, alloc = make_cache(20 * P - 1, P)
    a = insert_fresh(cache, [1] * (3 * P))
    b_key = [1] * (P + 4) + [2] * (2 * P - 4)  # differs from a at position 20
    mine = alloc.alloc(len(b_key))
    assert mine is not None
    assert cache.insert(b_key, mine) == P
    alloc.free(mine[:P])
    kv, node = cache.match_prefix(b_key)
    assert kv.tolist() == a[:P].tolist() + mine[P:].tolist()
    assert all(len(n.key) % P == 0 for n in cache._all_nodes())
    upper = node.parent
    assert upper is not None and upper.key == [1] * P and len(upper.children) == 2
    assert cache.match_prefix([1] * (3 * P)).kv_indices.tolist() == a.tolist()
    assert cache.total_size() == 5 * P
    assert_accounted(cache, alloc)


def test_paged_siblings_sharing_a_first_token_are_distinct_children() -> None:
    cache, alloc = make_cache(20 * P - 1, P)
    insert_fresh(cache, [7] + [1] * (P - 1))
    insert_fresh(cache, [7] + [2] * (P - 1))
    root = cache._root(None)
    assert len(root.children) == 2
    assert cache.match_prefix([7] + [2] * (P - 1)).kv_indices.numel() == P
    assert cache.evict(1) == P and cache.total_size() == P
    assert_accounted(cache, alloc)


def test_paged_requests_keep_their_partial_page_and_free_it_at_the_end() -> None:
    cache, alloc = make_cache(20 * P - 1, P)
    pool = cache.req_to_token
    ids = list(range(3, 3 + 2 * P + 5))
    req = _running_req(pool, alloc, ids)
    cache.cache_unfinished_req(req)
    assert req.prefix_len == 2 * P and cache.locked_size == 2 * P
    # Held by the request: its partial third page.
    assert_accounted(cache, alloc, held=P)
    cache.cache_finished_req(req)
    assert cache.evictable_size == 2 * P and cache.locked_size == 0
    assert_accounted(cache, alloc)
    assert cache.evict(100) == 2 * P and alloc.available() == alloc.size


# -- property-based: RadixCache against a naive reference -----------------------------------

POOL_PAGES = 20
NAMESPACES = (None, "ns")
# A key is a list of page "shapes" and a tail length; see RadixCacheMachine.expand.
keys = st.tuples(st.lists(st.integers(1, 5), min_size=1, max_size=7), st.integers(0, 15))


class RadixCacheMachine(RuleBasedStateMachine):
    """The reference is, per namespace, a dict {cached prefix (tuple, whole pages): slots of
    its last page}; it is prefix-closed. Eviction is checked through the slots the allocator
    sees freed."""

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        p = self.page_size
        self.alloc = TrackingAllocator((POOL_PAGES + 1) * p - 1, p)
        self.cache = RadixCache(self.alloc, ReqToTokenPool(2, 8))
        self.ref: dict[str | None, dict[tuple[int, ...], tuple[int, ...]]] = {
            ns: {} for ns in NAMESPACES
        }
        self.locks: list[tuple[str | None, tuple[int, ...], TreeNode, list[int]]] = []
        self.pending: list[tuple[str | None, list[int], torch.Tensor]] = []  # held by the test

    def expand(self, raw: tuple[list[int], int]) -> list[int]:
        """Page shapes 1-3 are uniform pages; 4 and 5 share their first token (4: all but the
        last) with shape 1, so keys diverge inside pages. Page size 1: tokens 1, 2, 3."""
        shapes, tail = raw
        p = self.page_size
        if p == 1:
            return [(s - 1) % 3 + 1 for s in shapes]
        pages = {1: [1] * p, 2: [2] * p, 3: [3] * p, 4: [1] * (p - 1) + [2], 5: [1] + [3] * (p - 1)}
        return [t for s in shapes for t in pages[s]] + [1] * (tail % p)

    def pages(self, n: int) -> int:
        return -(-n // self.page_size)

    # -- reference helpers --

    def ref_match(self, ns: str | None, key: list[int]) -> list[int]:
        out: list[int] = []
        p = self.page_size
        for i in range(1, len(key) // p + 1):
            slots = self.ref[ns].get(tuple(key[: i * p]))
            if slots is None:
                break
            out += slots
        return out

    def evict(self, n: int) -> None:
        log_start = len(self.alloc.freed_log)
        evictable_before = self.cache.evictable_size
        freed = self.cache.evict(n)
        slots = set(self.alloc.freed_log[log_start:])
        assert freed == len(slots) == len(self.alloc.freed_log) - log_start
        assert freed % self.page_size == 0
        assert freed >= min(n, evictable_before), "evict stopped while it could free more"
        for ns in NAMESPACES:
            gone = [p for p, s in self.ref[ns].items() if s[0] in slots]
            for p in gone:
                del self.ref[ns][p]
            for p in self.ref[ns]:  # still prefix-closed: only whole suffixes were evicted
                assert len(p) == self.page_size or p[: -self.page_size] in self.ref[ns]
        for ns, prefix, _, _ in self.locks:
            assert prefix in self.ref[ns] or not prefix, "evicted a locked prefix"

    # -- rules --

    def _compute(self, ns: str | None, key: list[int]) -> bool:
        """A request computes KV for ``key`` into fresh pages (evicting if needed)."""
        slots = self.alloc.alloc(len(key))
        if slots is None:
            self.evict(self.pages(len(key)) * self.page_size - self.alloc.available())
            slots = self.alloc.alloc(len(key))
        if slots is not None:
            self.pending.append((ns, key, slots))
        return slots is not None

    @rule(ns=st.sampled_from(NAMESPACES), raw=keys)
    def compute(self, ns: str | None, raw: tuple[list[int], int]) -> None:
        self._compute(ns, self.expand(raw))

    @rule(ns=st.sampled_from(NAMESPACES), raw=keys)
    def compute_and_insert(self, ns: str | None, raw: tuple[list[int], int]) -> None:
        if self._compute(ns, self.expand(raw)):
            self.insert(len(self.pending) - 1)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100))
    def insert(self, i: int) -> None:
        ns, key, slots = self.pending.pop(i % len(self.pending))
        p = self.page_size
        aligned = len(key) - len(key) % p
        expected_already = len(self.ref_match(ns, key))
        already = self.cache.insert(key, slots, ns)
        assert already == expected_already
        self.alloc.free(slots[:already])
        self.alloc.free(slots[aligned:])  # the partial last page is never cached
        for j in range(already // p, aligned // p):
            self.ref[ns][tuple(key[: (j + 1) * p])] = tuple(slots[j * p : (j + 1) * p].tolist())

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100))
    def drop(self, i: int) -> None:
        """A request aborts before caching: its slots go straight back."""
        _, _, slots = self.pending.pop(i % len(self.pending))
        self.alloc.free(slots)

    @rule(ns=st.sampled_from(NAMESPACES), raw=keys)
    def match(self, ns: str | None, raw: tuple[list[int], int]) -> None:
        key = self.expand(raw)
        kv, node = self.cache.match_prefix(key, ns)
        assert kv.tolist() == self.ref_match(ns, key)
        depth = 0
        while node.parent is not None:
            depth += len(node.key)
            node = node.parent
        assert depth == kv.numel()
        assert self.cache._root(ns) is node

    @rule(ns=st.sampled_from(NAMESPACES), raw=keys)
    def lock(self, ns: str | None, raw: tuple[list[int], int]) -> None:
        key = self.expand(raw)
        kv, node = self.cache.match_prefix(key, ns)
        self.cache.inc_lock_ref(node)
        self.locks.append((ns, tuple(key[: kv.numel()]), node, kv.tolist()))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        _, _, node, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(1, POOL_PAGES * 16))
    def evict_some(self, n: int) -> None:
        self.evict(n)

    # -- invariants --

    @invariant()
    def tree_matches_reference(self) -> None:
        ref_slots = [s for r in self.ref.values() for page in r.values() for s in page]
        in_tree = tree_slots(self.cache)
        assert sorted(in_tree) == sorted(ref_slots)
        assert len(set(in_tree)) == len(in_tree), "a slot is held twice by the tree"
        assert not set(in_tree) & self.alloc.free_set, "a slot is both free and in the tree"
        held = sum(self.pages(len(s)) * self.page_size for _, _, s in self.pending)
        assert not {s for _, _, t in self.pending for s in t.tolist()} & self.alloc.free_set
        assert_accounted(self.cache, self.alloc, held)
        assert self.alloc.available() == len(self.alloc.free_set)

    @invariant()
    def locked_prefixes_still_match_fully(self) -> None:
        locked: set[tuple[str | None, tuple[int, ...]]] = set()
        p = self.page_size
        for ns, prefix, _, kv in self.locks:
            assert self.ref_match(ns, list(prefix)) == kv
            assert self.cache.match_prefix(list(prefix), ns).kv_indices.tolist() == kv
            locked |= {(ns, prefix[: i * p]) for i in range(1, len(prefix) // p + 1)}
        assert self.cache.locked_size == len(locked) * p

    @invariant()
    def lock_refs_count_the_locks_below(self) -> None:
        direct: dict[int, int] = {}
        for _, _, node, _ in self.locks:
            direct[id(node)] = direct.get(id(node), 0) + 1
        locked = evictable = 0
        for node in self.cache._all_nodes():
            below = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref == direct.get(id(node), 0) + below
            assert len(node.key) % self.page_size == 0 and len(node.key) == len(node.value)
            for t, c in node.children.items():
                assert c.parent is node and self.cache._child_key(c.key) == t
            if node.lock_ref:
                locked += len(node.key)
            else:
                evictable += len(node.key)
        assert (self.cache.locked_size, self.cache.evictable_size) == (locked, evictable)


class PagedRadixCacheMachine(RadixCacheMachine):
    page_size = 16


MACHINE_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheMachine = RadixCacheMachine.TestCase
TestRadixCacheMachine.settings = MACHINE_SETTINGS
TestPagedRadixCacheMachine = PagedRadixCacheMachine.TestCase
TestPagedRadixCacheMachine.settings = MACHINE_SETTINGS


# -- peek_prefix (read-only matching for queue ordering) ------------------------------------


def test_peek_prefix_counts_the_match_without_changing_the_tree() -> None:
    cache, _ = make_cache()
    insert_fresh(cache, [1, 2, 3, 4, 5])
    insert_fresh(cache, [1, 2, 9])
    stamps = {id(n): n.last_access for n in cache._all_nodes()}
    keys = sorted(n.key for n in cache._all_nodes())
    n, node = cache.peek_prefix([1, 2, 3, 4, 7])
    assert n == 4 and node.key == [3, 4, 5], "ends inside the node, which is not split"
    assert cache.peek_prefix([1, 2, 9, 9]) == (3, node.parent.children[9])
    assert cache.peek_prefix([1, 2])[0] == 2
    assert cache.peek_prefix([7]) == (0, node.parent.parent)
    assert cache.peek_prefix([]) == (0, node.parent.parent)
    assert sorted(n.key for n in cache._all_nodes()) == keys
    assert {id(n): n.last_access for n in cache._all_nodes()} == stamps
    n, root = cache.peek_prefix([1, 2, 3], extra_key="other")
    assert n == 0 and root.parent is None and root is not node.parent.parent
    assert cache.match_prefix([1, 2, 3, 4, 7]).kv_indices.numel() == 4


def test_peek_prefix_is_page_aligned() -> None:
    cache, _ = make_cache(page_size=2)
    insert_fresh(cache, [1, 2, 3, 4, 5, 6])
    assert cache.peek_prefix([1, 2, 3, 4, 5, 6])[0] == 6
    assert cache.peek_prefix([1, 2, 3, 4, 5])[0] == 4
    assert cache.peek_prefix([1, 2, 3, 9, 5, 6])[0] == 2


# -- exact behaviour of the helpers, the roots, locks and requests (mutation survivors) ------


def test_common_prefix_len_matches_a_token_by_token_loop() -> None:
    def naive(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    words = [[]] + [[int(c) for c in format(i, f"0{n}b")] for n in range(1, 6) for i in range(2**n)]
    for a in words:
        for b in words:
            assert _common_prefix_len(a, b) == naive(a, b), (a, b)
    assert _common_prefix_len([1], [2]) == 0
    assert _common_prefix_len([5, 1, 2], [6, 1, 2]) == 0
    long = list(range(1000))
    assert _common_prefix_len(long, long[:617] + [-1] + long[618:]) == 617


def test_tree_nodes_order_strictly_by_last_access() -> None:
    a, b = TreeNode([1], _slots(1), None), TreeNode([2], _slots(2), None)
    a.last_access, b.last_access = 3, 5
    assert a < b and not b < a
    b.last_access = 3
    assert not a < b and not b < a, "equal stamps: neither is older"
    fresh = TreeNode([], _slots(), None)
    assert (fresh.children, fresh.lock_ref, fresh.parent) == ({}, 0, None)


def _slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _assert_empty_root(node: TreeNode) -> None:
    assert node.parent is None and node.key == [] and node.value.numel() == 0


def test_a_match_that_ends_at_the_root_returns_the_empty_root() -> None:
    cache, _ = make_cache()
    kv, node = cache.match_prefix([1, 2])
    _assert_empty_root(node)
    insert_fresh(cache, [1, 2])
    kv, node = cache.match_prefix([3, 1, 2])
    assert kv.numel() == 0 and node is cache._root(None) and list(node.children) == [1]
    _assert_empty_root(node)
    _assert_empty_root(cache.match_prefix([1, 2], "ns").last_node)
    n, node = cache.peek_prefix([1, 2], "other")
    assert n == 0
    _assert_empty_root(node)


def test_dec_lock_ref_on_an_unlocked_node_fails() -> None:
    cache, _ = make_cache()
    insert_fresh(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_node
    with pytest.raises(AssertionError, match="^dec_lock_ref on an unlocked node$"):
        cache.dec_lock_ref(node)
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    with pytest.raises(AssertionError, match="^dec_lock_ref on an unlocked node$"):
        cache.dec_lock_ref(node)


def test_lock_accounting_along_a_three_node_path() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, [1, 2, 3, 4, 5, 6])
    insert_fresh(cache, [1, 2, 3, 4, 9])  # splits: [1, 2, 3, 4] -> {[5, 6], [9]}
    insert_fresh(cache, [1, 2, 7])  # splits: [1, 2] -> {[3, 4] -> ..., [7]}
    assert (cache.locked_size, cache.evictable_size, cache.total_size()) == (0, 8, 8)
    deep = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    mid = deep.parent
    assert deep.key == [5, 6] and mid is not None and mid.key == [3, 4]
    top = mid.parent
    assert top is not None and top.key == [1, 2]
    cache.inc_lock_ref(deep)
    assert (cache.locked_size, cache.evictable_size) == (6, 2)
    assert (top.lock_ref, mid.lock_ref, deep.lock_ref) == (1, 1, 1)
    seven = cache.match_prefix([1, 2, 7]).last_node
    cache.inc_lock_ref(seven)  # shares [1, 2]
    assert (cache.locked_size, cache.evictable_size) == (7, 1)
    assert (top.lock_ref, mid.lock_ref, seven.lock_ref) == (2, 1, 1)
    cache.dec_lock_ref(deep)
    assert (cache.locked_size, cache.evictable_size) == (3, 5)
    assert (top.lock_ref, mid.lock_ref, deep.lock_ref) == (1, 0, 0)
    assert cache.evict(100) == 5  # [5, 6], [9], then [3, 4]: never [1, 2] or [7]
    assert cache.match_prefix([1, 2, 7]).kv_indices.numel() == 3
    assert cache.match_prefix([1, 2, 3]).kv_indices.numel() == 2
    cache.dec_lock_ref(seven)
    assert (cache.locked_size, cache.evictable_size) == (0, 3)
    assert_accounted(cache, alloc)


def test_evict_pops_leaves_in_last_access_order_and_stops_when_enough_is_freed() -> None:
    cache, alloc = make_cache()
    a = insert_fresh(cache, [1, 1])
    b = insert_fresh(cache, [2, 2, 2])
    c = insert_fresh(cache, [3])
    cache.match_prefix([1, 1])  # order by last access now: b, c, a
    log = len(alloc.freed_log)
    assert cache.evict(3) == 3
    assert alloc.freed_log[log:] == b.tolist()
    assert cache.evict(1) == 1
    assert alloc.freed_log[log + 3 :] == c.tolist()
    assert cache.evict(0) == 0
    assert cache.evict(5) == 2 and alloc.freed_log[log + 4 :] == a.tolist()
    assert cache.evict(5) == 0
    assert (cache.total_size(), cache.evictable_size, alloc.available()) == (0, 0, alloc.size)


def test_reset_forgets_every_namespace_and_the_sizes() -> None:
    cache, _ = make_cache()
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [1, 2], extra_key="ns")
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    cache.reset()
    assert (cache.total_size(), cache.evictable_size, cache.locked_size) == (0, 0, 0)
    assert cache.match_prefix([1, 2]).kv_indices.numel() == 0
    assert cache.match_prefix([1, 2], "ns").kv_indices.numel() == 0


def test_page_size_2_inserts_only_whole_pages() -> None:
    cache, alloc = make_cache(page_size=2)
    slots = alloc.alloc(5)
    assert slots is not None
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    alloc.free(slots[4:])
    assert (cache.total_size(), cache.evictable_size) == (4, 4)
    assert [n.key for n in cache._all_nodes()] == [[1, 2, 3, 4]]
    assert cache.match_prefix([1, 2, 3, 4, 5]).kv_indices.tolist() == slots[:4].tolist()
    assert cache.match_prefix([1, 2, 3]).kv_indices.tolist() == slots[:2].tolist()
    mine = alloc.alloc(3)
    assert mine is not None
    assert cache.insert([1, 2, 3], mine) == 2  # only [1, 2] was compared: [3] is no page
    alloc.free(mine)
    assert cache.total_size() == 4
    assert_accounted(cache, alloc)


def test_requests_with_an_extra_key_cache_in_their_namespace_only() -> None:
    cache, alloc = make_cache()
    pool = cache.req_to_token
    shared = insert_fresh(cache, [1, 2, 3], extra_key="ns")
    insert_fresh(cache, [1, 2, 3, 4])  # the same tokens outside the namespace
    before = alloc.available()
    req = Req("r", [1, 2, 3, 4, 5], SamplingParams(), extra_key="ns")
    req.req_pool_idx = pool.alloc()
    mine = alloc.alloc(5)
    assert req.req_pool_idx is not None and mine is not None
    pool.table[req.req_pool_idx, :5] = mine
    req.kv_len = 5
    cache.cache_unfinished_req(req)
    assert alloc.available() == before - 2, "the 3 duplicates of the namespace's prefix freed"
    assert req.prefix_len == 5 and req.cache_node.key == [4, 5]
    row = pool.table[req.req_pool_idx, :5].tolist()
    assert row == shared.tolist() + mine[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5], "ns").kv_indices.tolist() == row
    assert cache.match_prefix([1, 2, 3, 4, 5]).kv_indices.numel() == 4
    assert (cache.locked_size, cache.evictable_size) == (5, 4)
    cache.cache_finished_req(req)
    assert alloc.available() == before - 2 and req.prefix_len == 0 and req.cache_node is None
    assert (cache.locked_size, cache.evictable_size) == (0, 9)
    assert cache.match_prefix([1, 2, 3, 4, 5], "ns").kv_indices.tolist() == row
    assert_accounted(cache, alloc)


def test_finished_request_with_an_extra_key_inserts_into_its_namespace() -> None:
    cache, alloc = make_cache()
    pool = cache.req_to_token
    req = Req("r", [1, 2, 3], SamplingParams(), extra_key="ns")
    req.req_pool_idx = pool.alloc()
    mine = alloc.alloc(3)
    assert req.req_pool_idx is not None and mine is not None
    pool.table[req.req_pool_idx, :3] = mine
    req.kv_len = 3
    cache.cache_finished_req(req)
    assert cache.match_prefix([1, 2, 3], "ns").kv_indices.tolist() == mine.tolist()
    assert cache.match_prefix([1, 2, 3]).kv_indices.numel() == 0
    assert (cache.total_size(), cache.evictable_size, alloc.available()) == (3, 3, alloc.size - 3)


def test_chunked_prefill_moves_the_lock_to_the_newest_node() -> None:
    cache, alloc = make_cache()
    pool = cache.req_to_token
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    req = Req("r", ids, SamplingParams())
    req.req_pool_idx = pool.alloc()
    first = alloc.alloc(4)
    assert req.req_pool_idx is not None and first is not None
    pool.table[req.req_pool_idx, :4] = first
    req.kv_len = 4
    cache.cache_unfinished_req(req)  # chunk 1
    node1 = req.cache_node
    assert req.prefix_len == 4 and node1.key == [1, 2, 3, 4] and node1.lock_ref == 1
    assert (cache.locked_size, cache.evictable_size) == (4, 0)
    second = alloc.alloc(4)
    assert second is not None
    pool.table[req.req_pool_idx, 4:8] = second
    req.kv_len = 8
    cache.cache_unfinished_req(req)  # chunk 2: lock the new node, release the old lock
    node2 = req.cache_node
    assert req.prefix_len == 8 and node2.key == [5, 6, 7, 8] and node2.parent is node1
    assert (node1.lock_ref, node2.lock_ref) == (1, 1)
    assert (cache.locked_size, cache.evictable_size) == (8, 0)
    assert alloc.available() == alloc.size - 8
    assert pool.table[req.req_pool_idx, :8].tolist() == first.tolist() + second.tolist()
    cache.cache_finished_req(req)
    assert (node1.lock_ref, node2.lock_ref) == (0, 0)
    assert (cache.locked_size, cache.evictable_size) == (0, 8)
    assert alloc.available() == alloc.size - 8
    assert_accounted(cache, alloc)


def test_no_prefix_cache_returns_empty_roots_and_frees_exactly_the_request() -> None:
    alloc = TrackingAllocator(16)
    pool = ReqToTokenPool(2, 16)
    cache = NoPrefixCache(alloc, pool)
    kv, node = cache.match_prefix([1, 2, 3], "ns")
    assert kv.numel() == 0
    _assert_empty_root(node)
    n, node = cache.peek_prefix([1, 2, 3], "ns")
    assert n == 0
    _assert_empty_root(node)
    req = _running_req(pool, alloc, [1, 2, 3, 4])
    other = _running_req(pool, alloc, [5, 6])
    req.prefix_len, req.cache_node = 3, node
    cache.cache_unfinished_req(req)
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    assert alloc.available() == 10 and cache.total_size() == 0 and cache.evict(10) == 0
    assert (cache.evictable_size, cache.locked_size) == (0, 0)
    cache.cache_finished_req(req)
    assert alloc.available() == 14 and req.prefix_len == 0 and req.cache_node is None
    assert not set(pool.table[other.req_pool_idx, :2].tolist()) & set(alloc.freed_log)
    cache.reset()
    assert cache.total_size() == 0
