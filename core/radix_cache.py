"""RadixCache: a radix tree over token ids whose nodes own KV slots of the shared pool.

Matches are exact and page-aligned: with page size P every node holds a multiple of P tokens,
``match_prefix`` returns the longest cached prefix rounded down to whole pages, and only whole
pages are inserted (a request's partial last page stays its own and is freed when it ends).
Children are keyed by their first token (P = 1) or their first page of tokens (P > 1). Nodes in
use by running requests are locked (reference counted, up to the root); ``evict`` frees
least-recently-used unlocked leaves first.
Invariant at idle: ``allocator.available() + evictable_size + locked_size == pool size``.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

import torch

from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.core.request import Req

_EMPTY = torch.empty(0, dtype=torch.int64)
ChildKey = int | tuple[int, ...]  # a child's first token (page size 1) or first page


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


class MatchResult(NamedTuple):
    kv_indices: torch.Tensor
    last_node: TreeNode


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    # List slice comparisons run in C; a bisection over them beats a Python loop per token on
    # the long prompts that prefix caching is for.
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixCache:
    """The shared prefix cache. ``extra_key`` (cache salt, LoRA id) keeps namespaces disjoint."""

    node_type: type[TreeNode] = TreeNode  # a subclass's nodes may carry more (core/hicache.py)

    def __init__(self, allocator: TokenAllocator, req_to_token: ReqToTokenPool) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = allocator.page_size
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self._roots: dict[str | None, TreeNode] = {}
        self.evictable_size = 0
        self.locked_size = 0

    def _root(self, extra_key: str | None) -> TreeNode:
        root = self._roots.get(extra_key)
        if root is None:
            root = self.node_type([], _EMPTY, None)
            root.lock_ref = 1  # the root is never evicted
            self._roots[extra_key] = root
        return root

    # -- tree operations --------------------------------------------------------------------

    def _child_key(self, key: list[int]) -> ChildKey:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached prefix of ``key`` in whole pages: its KV slots and the deepest node
        matched."""
        if self.page_size > 1:
            key = key[: self._aligned(len(key))]
        path, _ = self._walk(key, extra_key)
        kv = torch.cat([n.value for n in path]) if path else _EMPTY
        return MatchResult(kv, path[-1] if path else self._root(extra_key))

    def _walk(self, key: list[int], extra_key: str | None) -> tuple[list[TreeNode], list[int]]:
        """The nodes ``key`` matches in whole pages, splitting the last one where the match
        ends inside it (an LRU refresh of each); what of ``key`` is left."""
        node = self._root(extra_key)
        now = next(self._clock)
        node.last_access = now
        path: list[TreeNode] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            # NOTE: the child key is the first page, so at least one whole page matches.
            n = self._aligned(_common_prefix_len(child.key, key))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            path.append(child)
            node, key = child, key[n:]
        return path, key

    def peek_prefix(self, key: list[int], extra_key: str | None = None) -> tuple[int, TreeNode]:
        """How many leading tokens of ``key`` are cached (whole pages), and the node the match
        ends in. Read-only: no split, no LRU refresh, so ordering a queue never changes the
        tree; only admission (``match_prefix``) and ``insert`` do."""
        node = self._roots.get(extra_key)
        if node is None:
            return 0, self._root(extra_key)
        if self.page_size > 1:
            key = key[: self._aligned(len(key))]
        matched = 0
        while matched < len(key):
            child = node.children.get(self._child_key(key[matched:]))
            if child is None:
                break
            n = self._aligned(_common_prefix_len(child.key, key[matched:]))
            matched += n
            node = child
            if n < len(child.key):
                break
        return matched, node

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Insert the whole pages of ``key`` with their KV slots; return how many leading tokens
        were already cached (a multiple of the page size; the caller owns, and must free, its
        slots for those and for the partial last page that is not inserted)."""
        node = self._root(extra_key)
        now = next(self._clock)
        matched = 0
        if self.page_size > 1:
            n = self._aligned(len(key))
            key, value = key[:n], value[:n]
        on_device = True
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                self._add_leaf(node, key, value, now)
                break
            n = self._aligned(_common_prefix_len(child.key, key))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            on_device = self._keeps_device_kv(child, value, n) and on_device
            if on_device:
                matched += n
            node, key, value = child, key[n:], value[n:]
        return matched

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, now: int
    ) -> TreeNode:
        """A new ``node_type`` leaf under ``parent`` holding the rest of an inserted key and its
        slots."""
        leaf = self.node_type(list(key), value.clone(), parent)
        leaf.last_access = now
        parent.children[self._child_key(key)] = leaf
        self.evictable_size += len(key)
        return leaf

    def _keeps_device_kv(self, child: TreeNode, value: torch.Tensor, n: int) -> bool:
        """Whether an inserted key's node ``child`` (its first ``n`` slots in ``value``)
        already held device KV, which the caller's slots then duplicate; always, here (a
        tier below device memory may have nodes without it)."""
        return True

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after its first n tokens; return the new upper node."""
        assert child.parent is not None
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children = {self._child_key(child.key[n:]): child}
        child.parent.children[self._child_key(child.key)] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        return upper

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.locked_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "dec_lock_ref on an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.locked_size -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked LRU leaves, if possible; return the
        number freed."""
        leaves = [n for n in self._all_nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            del parent.children[self._child_key(leaf.key)]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def flush(self) -> None:
        """Drop every cached prefix no running request holds (their KV is not trusted, or
        asked to go)."""
        self.evict(1 << 62)

    def clear_storage(self) -> bool:
        """Drop what a storage tier holds (False: there is none)."""
        return False

    def check_tiers(self) -> None:
        """Raise AssertionError when a tier behind the device pool leaks (none here)."""

    def tier_stats(self) -> dict[str, int] | None:
        """Hits and moves per tier (None: one tier only)."""
        return None

    def _all_nodes(self) -> list[TreeNode]:
        nodes: list[TreeNode] = []
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._all_nodes())

    # -- request integration ----------------------------------------------------------------

    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk: put the computed whole pages in the tree and lock them for
        ``req`` (a partial last page stays the request's own)."""
        assert req.req_pool_idx is not None
        row = self.req_to_token.table[req.req_pool_idx]
        aligned = self._aligned(req.kv_len)
        token_ids = req.fill_ids()[:aligned]
        kv = row[:aligned].clone()
        already = self.insert(token_ids, kv, req.extra_key)
        self.allocator.free(kv[req.prefix_len : already])
        new_kv, new_node = self.match_prefix(token_ids, req.extra_key)
        # Positions below prefix_len already hold the tree's slots; from there on, a duplicate
        # of a cached range now points at the tree's copy (ours was freed above).
        self.req_to_token.write(req.req_pool_idx, req.prefix_len, new_kv[req.prefix_len :])
        self.inc_lock_ref(new_node)
        if req.cache_node is not None:
            self.dec_lock_ref(req.cache_node)
        req.cache_node, req.prefix_len = new_node, len(new_kv)

    def cache_finished_req(self, req: Req) -> None:
        """Release ``req``'s KV: computed whole pages go into the tree, its partial last page
        is freed, its lock is dropped."""
        assert req.req_pool_idx is not None
        kv = self.req_to_token.table[req.req_pool_idx, : req.kv_len].clone()
        aligned = self._aligned(req.kv_len)
        already = self.insert(req.fill_ids()[:aligned], kv[:aligned], req.extra_key)
        self.allocator.free(kv[req.prefix_len : already])
        self.allocator.free(kv[aligned:])
        if req.cache_node is not None:
            self.dec_lock_ref(req.cache_node)
        req.cache_node, req.prefix_len = None, 0


class NoPrefixCache:
    """``--disable-radix-cache``: nothing is shared; a request's KV is freed when it ends."""

    evictable_size = 0
    locked_size = 0

    def __init__(self, allocator: TokenAllocator, req_to_token: ReqToTokenPool) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token

    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(_EMPTY, TreeNode([], _EMPTY, None))

    def peek_prefix(self, key: list[int], extra_key: str | None = None) -> tuple[int, TreeNode]:
        return 0, TreeNode([], _EMPTY, None)

    def cache_unfinished_req(self, req: Req) -> None:
        pass

    def cache_finished_req(self, req: Req) -> None:
        assert req.req_pool_idx is not None
        self.allocator.free(self.req_to_token.table[req.req_pool_idx, : req.kv_len].clone())
        req.cache_node, req.prefix_len = None, 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def flush(self) -> None:
        pass

    def clear_storage(self) -> bool:
        return False

    def check_tiers(self) -> None:
        pass

    def tier_stats(self) -> dict[str, int] | None:
        return None

    def total_size(self) -> int:
        return 0
