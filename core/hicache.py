"""HiRadixCache: the radix cache with a host tier (and a storage tier) behind the device pool.

Each node records where its KV lives: ``value`` (device slots, None once demoted), and
``host_value`` (host slots, None when it has no host copy); storage holds pages by the hash
chain of their prefix (core/hicache_storage.py), so a prefix there is found by its tokens, also
after a restart. Invariants:

- device-resident nodes form a subtree under the root: a node on the device has its parent on
  the device, so the device leaves (device nodes without device children) are what eviction
  takes, and a match ends in a device part followed by a host part;
- a node is on the device, or in host memory, or both; one that is neither leaves the tree;
- locks (``lock_ref``) and ``evictable_size`` / ``locked_size`` count device nodes only, so the
  device pool's accounting is the radix cache's; the host pool's is ``host_accounting``.

Device eviction demotes a node to the host (copying it first unless it has a host copy; the
write policy decides when copies are made) instead of dropping it; host eviction drops host
leaves, writing them to storage first when a backend is set. ``match_prefix`` loads the host
part of a match (and the pages storage holds after it) back into fresh device pages before the
request's prefill uses them.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Any, cast

import torch

from radixserve.core.hicache_pool import HostKVPool
from radixserve.core.hicache_storage import GuardedStorage, page_keys
from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.core.radix_cache import MatchResult, RadixCache, TreeNode
from radixserve.core.request import Req

logger = logging.getLogger(__name__)
_EMPTY = torch.empty(0, dtype=torch.int64)


class HiTreeNode(TreeNode):
    __slots__ = ("host_value", "host_ref", "hit_count", "stored", "backup", "load_batch")
    value: torch.Tensor | None  # type: ignore[assignment]  # None: not on the device

    def __init__(self, key: list[int], value: torch.Tensor | None, parent: TreeNode | None) -> None:
        super().__init__(key, value, parent)  # type: ignore[arg-type]
        self.host_value: torch.Tensor | None = None
        self.host_ref = 0  # > 0 while a match loads it: host eviction leaves it
        self.hit_count = 0
        self.stored = False  # its pages were written to storage
        # the host pool's event of the copy to host_value (HostKVPool.backup), None when done
        # in the compute stream's order: fenced before the device slots are freed
        self.backup: Any = None
        # the host pool's batch of loads that wrote its device slots (HostKVPool.load): its
        # slots are freed only once that batch went out
        self.load_batch = -1


@dataclass
class HiCacheStats:
    """Tokens per tier since start: matched on the device, loaded from host and from storage;
    demoted device -> host, dropped from the host, written to storage."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    demoted_tokens: int = 0
    host_evicted_tokens: int = 0
    storage_written_pages: int = 0
    dropped_tokens: int = 0  # evicted from the device without a host copy
    # prefetch (core/hicache_prefetch.py): storage -> host, host -> device, while queued
    prefetch_storage_tokens: int = 0
    prefetch_device_tokens: int = 0
    prefetch_cancelled: int = 0  # prefetches of requests that ended while queued

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


class HiRadixCache(RadixCache):
    node_type = HiTreeNode

    def __init__(
        self,
        allocator: TokenAllocator,
        req_to_token: ReqToTokenPool,
        host: HostKVPool,
        write_policy: str,
        storage: GuardedStorage | None = None,
        namespace: str = "",
    ) -> None:
        self.host = host
        self.write_policy = write_policy
        self.storage = storage
        self.namespace = namespace
        self.stats = HiCacheStats()
        self._counting = True
        # False once prefetch reads storage off the engine thread (core/hicache_prefetch.py)
        self.sync_storage = True
        super().__init__(allocator, req_to_token)

    # -- accounting ---------------------------------------------------------------------------

    def host_accounting(self) -> dict[str, int]:
        """The host pool: size, free, held by nodes (all in tokens)."""
        held = sum(len(n.key) for n in self._hi_nodes() if n.host_value is not None)
        return {"size": self.host.size, "free": self.host.allocator.available(), "held": held}

    def check_tiers(self) -> None:
        """Raise AssertionError when the tiers' bookkeeping is off: a host slot neither free
        nor a node's, a device node under a node off the device, a node in no tier, or device
        sizes that differ from ``evictable_size`` / ``locked_size``."""
        acct = self.host_accounting()
        if acct["free"] + acct["held"] != acct["size"]:
            raise AssertionError(f"host KV leak: {acct}")
        evictable = locked = 0
        for node in self._hi_nodes():
            if node.value is None and node.host_value is None:
                raise AssertionError("a node in no tier stayed in the tree")
            parent = node.parent
            if node.value is not None and parent is not None and parent.value is None:
                raise AssertionError("a device node under a node off the device")
            if node.value is not None:
                if node.lock_ref:
                    locked += len(node.key)
                else:
                    evictable += len(node.key)
        if (evictable, locked) != (self.evictable_size, self.locked_size):
            raise AssertionError(
                f"device sizes {evictable}/{locked} counted {self.evictable_size}/"
                f"{self.locked_size} (evictable/locked)"
            )

    def tier_stats(self) -> dict[str, int] | None:
        acct = self.host_accounting()
        errors = self.storage.errors if self.storage is not None else 0
        return {**self.stats.to_json(), "host_size": acct["size"], "host_held": acct["held"],
                "storage_errors": errors}  # fmt: skip

    def _hi_nodes(self) -> list[HiTreeNode]:
        return self._all_nodes()  # type: ignore[return-value]

    # -- matching (loads host and storage spans back) -----------------------------------------

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        if self.page_size > 1:
            key = key[: self._aligned(len(key))]
        walked, rest = self._walk(key, extra_key)
        path = cast(list[HiTreeNode], walked)  # this tree's nodes are all HiTreeNodes
        fetched_now = False
        if self.storage is not None and self.sync_storage and len(rest) >= self.page_size:
            fetched = self._fetch_storage(key, len(key) - len(rest), path, extra_key)
            if fetched is not None:
                path.append(fetched)
                fetched_now = True
        on_device = [n for n in path if n.value is not None]
        if self._counting:
            self.stats.device_hit_tokens += sum(len(n.key) for n in on_device)
            self._hit(on_device)
        if len(on_device) < len(path):
            loaded = self._load(path[len(on_device) :], on_device)
            if self._counting:
                for node in loaded:
                    tokens = len(node.key)
                    if node is path[-1] and fetched_now:
                        self.stats.storage_hit_tokens += tokens
                    else:
                        self.stats.host_hit_tokens += tokens
            on_device += loaded
        values = [n.value for n in on_device if n.value is not None]
        last = on_device[-1] if on_device else self._root(extra_key)
        return MatchResult(torch.cat(values) if values else _EMPTY, last)

    def _hit(self, nodes: list[HiTreeNode]) -> None:
        """write_through_selective: a device node hit a second time gets its host copy."""
        for node in nodes:
            node.hit_count += 1
            if (
                self.write_policy == "write_through_selective"
                and node.host_value is None
                and node.hit_count >= 2
            ):
                self._backup(node)

    def _load(self, nodes: list[HiTreeNode], above: list[HiTreeNode]) -> list[HiTreeNode]:
        """Give the host nodes ``nodes`` (a path's tail under the device nodes ``above``)
        device pages and copy their KV there; the nodes loaded (none when the pool cannot
        give the pages even after eviction)."""
        total = sum(len(n.key) for n in nodes)
        anchor = above[-1] if above else None
        for node in nodes:
            node.host_ref += 1
        if anchor is not None:
            self.inc_lock_ref(anchor)  # eviction must not take the part already matched
        try:
            slots = self.allocator.alloc(total)
            if slots is None:
                self.evict(total - self.allocator.available())
                slots = self.allocator.alloc(total)
        finally:
            if anchor is not None:
                self.dec_lock_ref(anchor)
            for node in nodes:
                node.host_ref -= 1
        if slots is None:
            return []
        host_slots = torch.cat([n.host_value for n in nodes if n.host_value is not None])
        batch = self.host.load(host_slots, slots, tuple(n.backup for n in nodes))
        start = 0
        for node in nodes:
            node.load_batch = batch
            node.value = slots[start : start + len(node.key)]
            start += len(node.key)
            self.evictable_size += len(node.key)
        return nodes

    def _fetch_storage(
        self, key: list[int], matched: int, path: list[HiTreeNode], extra_key: str | None
    ) -> HiTreeNode | None:
        """Pages after the first ``matched`` tokens of ``key`` that storage holds, read into
        host slots as a new host node under the match's last node; None when none is there."""
        assert self.storage is not None
        p = self.page_size
        keys = page_keys(key, p, self.namespace, extra_key, len(key) // p)[matched // p :]
        found = 0
        while found < len(keys) and self.storage.exists(keys[found]):
            found += 1
        if not found:
            return None
        for node in path:
            node.host_ref += 1
        try:
            host_slots = self._alloc_host(found * p)
        finally:
            for node in path:
                node.host_ref -= 1
        if host_slots is None:
            return None
        got = 0
        page = torch.empty(self.host.page_shape(p), dtype=self.host.dtype)
        while got < found and self.storage.get(keys[got], page):
            self.host.write_pages(host_slots[got * p : (got + 1) * p], page)
            got += 1
        self.host.allocator.free(host_slots[got * p :])
        if not got:
            return None
        parent = path[-1] if path else self._root(extra_key)
        node = HiTreeNode(key[matched : matched + got * p], None, parent)
        node.host_value, node.stored = host_slots[: got * p], True
        node.last_access = next(self._clock)
        parent.children[self._child_key(node.key)] = node
        return node

    # -- inserting (adopting the caller's device KV for host-only nodes) ----------------------

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, now: int
    ) -> TreeNode:
        leaf = super()._add_leaf(parent, key, value, now)
        assert isinstance(leaf, HiTreeNode)
        self._written(leaf)
        return leaf

    def _keeps_device_kv(self, child: TreeNode, value: torch.Tensor, n: int) -> bool:
        """A node only in host memory takes the caller's slots as its device copy (they count
        as new from there on, so the caller keeps them)."""
        if child.value is not None:
            return True
        child.value = value[:n].clone()
        self.evictable_size += n
        return False

    def _written(self, node: HiTreeNode) -> None:
        if self.write_policy == "write_through":
            self._backup(node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        assert child.parent is not None and isinstance(child, HiTreeNode)
        upper = HiTreeNode(child.key[:n], None if child.value is None else child.value[:n],
                           child.parent)  # fmt: skip
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.hit_count, upper.stored, upper.backup = child.hit_count, child.stored, child.backup
        upper.load_batch = child.load_batch
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        upper.children = {self._child_key(child.key[n:]): child}
        child.parent.children[self._child_key(child.key)] = upper
        child.parent = upper
        child.key = child.key[n:]
        if child.value is not None:
            child.value = child.value[n:]
        return upper

    # -- the tiers: copies, eviction ----------------------------------------------------------

    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.host.allocator.alloc(num_tokens)
        if slots is None:
            self._evict_host(num_tokens - self.host.allocator.available())
            slots = self.host.allocator.alloc(num_tokens)
        return slots

    def _backup(self, node: HiTreeNode) -> bool:
        """Copy device node ``node`` to the host pool (and storage); False without room."""
        assert node.value is not None
        node.host_ref += 1
        try:
            slots = self._alloc_host(len(node.key))
        finally:
            node.host_ref -= 1
        if slots is None:
            return False
        node.backup = self.host.backup(node.value, slots)
        node.host_value = slots
        self._store(node)
        return True

    def _store(self, node: HiTreeNode) -> None:
        """Write host node ``node``'s pages to storage (once; skipped pages stay unwritten)."""
        if self.storage is None or node.stored or node.host_value is None:
            return
        tokens = self._path_tokens(node)
        p = self.page_size
        first = (len(tokens) - len(node.key)) // p
        keys = page_keys(tokens, p, self.namespace, self._extra_key_of(node), len(tokens) // p)
        ok = True
        for i, page_key in enumerate(keys[first:]):
            if self.storage.exists(page_key):
                continue
            data = self.host.read_pages(node.host_value[i * p : (i + 1) * p])
            if self.storage.set(page_key, data):
                self.stats.storage_written_pages += 1
            else:
                ok = False
                break
        node.stored = ok

    def _path_tokens(self, node: TreeNode) -> list[int]:
        parts: list[list[int]] = []
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None:
            parts.append(walk.key)
            walk = walk.parent
        return [t for part in reversed(parts) for t in part]

    def _extra_key_of(self, node: TreeNode) -> str | None:
        while node.parent is not None:
            node = node.parent
        return next((k for k, root in self._roots.items() if root is node), None)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots from unlocked LRU device leaves, demoting
        each to the host (copying it first if the policy did not); return the number freed."""
        leaves = [n for n in self._hi_nodes() if self._device_leaf(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            if node.host_value is None and self.write_policy != "write_through_selective":
                self._backup(node)
            assert node.value is not None
            if self.host.queued(node.load_batch):  # a queued load still writes its slots
                self.host.issue_loads()
            self.host.fence(node.backup)  # its backup has read the slots before a step writes
            node.backup = None
            self.allocator.free(node.value)
            node.value = None
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            parent = node.parent
            if node.host_value is None:
                self.stats.dropped_tokens += len(node.key)
                self._drop_subtree(node)
            else:
                self.stats.demoted_tokens += len(node.key)
            if isinstance(parent, HiTreeNode) and self._device_leaf(parent):
                heapq.heappush(leaves, parent)
        return freed

    def _device_leaf(self, node: HiTreeNode) -> bool:
        return (
            node.value is not None
            and node.lock_ref == 0
            and node.parent is not None
            and all(c.value is None for c in node.children.values())
        )

    def _evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots from LRU host-only leaves (written to
        storage first when there is one); return the number freed."""
        leaves = [n for n in self._hi_nodes() if self._host_leaf(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            self._store(node)
            parent = node.parent
            freed += len(node.key)
            self.stats.host_evicted_tokens += len(node.key)
            self._drop_subtree(node)
            if isinstance(parent, HiTreeNode) and self._host_leaf(parent):
                heapq.heappush(leaves, parent)
        return freed

    @staticmethod
    def _host_leaf(node: HiTreeNode) -> bool:
        return (
            node.value is None
            and node.host_value is not None
            and node.host_ref == 0
            and not node.children
        )

    def _drop_subtree(self, node: HiTreeNode) -> None:
        """Take ``node`` (not on the device) and everything under it out of the tree."""
        assert node.parent is not None
        del node.parent.children[self._child_key(node.key)]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.value is None, "a device node under a node leaving the device"
            if n.host_value is not None:
                self.host.allocator.free(n.host_value)
                n.host_value = None
            stack.extend(n.children.values())  # type: ignore[arg-type]

    # -- request integration and admin --------------------------------------------------------

    def cache_unfinished_req(self, req: Req) -> None:
        self._counting = False  # its own re-match is no hit
        try:
            super().cache_unfinished_req(req)
        finally:
            self._counting = True

    def flush(self) -> None:
        """Drop every host copy and every unlocked device node (storage stays: see
        ``clear_storage``)."""
        self.host.issue_loads()  # before the slots they write are freed
        for root in self._roots.values():
            for child in list(root.children.values()):
                self._flush_under(child)  # type: ignore[arg-type]
        RadixCache.evict(self, 1 << 62)

    def _flush_under(self, node: HiTreeNode) -> None:
        if node.value is None:
            self._drop_subtree(node)
            return
        if node.host_value is not None:
            self.host.allocator.free(node.host_value)
            node.host_value = None
        node.stored = False
        for child in list(node.children.values()):
            self._flush_under(child)  # type: ignore[arg-type]

    def clear_storage(self) -> bool:
        if self.storage is None:
            return False
        for node in self._hi_nodes():
            node.stored = False
        return self.storage.clear()

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()
