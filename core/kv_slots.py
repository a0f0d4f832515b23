"""The scheduler's KV slots: allocating them for decodes, extends and prompts whose KV arrives
from elsewhere (evicting cache under pressure), freeing positions, releasing a request's KV
and row, and the pool's accounting. A base of ``core.scheduler.Scheduler``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.core.radix_cache import NoPrefixCache, RadixCache
from radixserve.core.request import Req
from radixserve.core.step_plan import SchedulerConfig
from radixserve.core.strategy_list import StrategyList


class KVSlots:
    """KV slot bookkeeping over the scheduler's allocator, slot table and cache."""

    config: SchedulerConfig
    allocator: TokenAllocator
    req_to_token: ReqToTokenPool
    cache: RadixCache | NoPrefixCache
    _uncached: NoPrefixCache  # embedding requests neither read nor fill the prefix cache
    running: list[Req]
    strategies: StrategyList

    def free_positions(self, req: Req, keep: int, end: int) -> None:
        """Give back the slots of positions [keep, end) of ``req``'s row, except those in the
        page that also holds position keep - 1 (the request keeps writing into it)."""
        assert req.req_pool_idx is not None
        p = self.allocator.page_size
        first = -(-keep // p) * p
        if first < end:
            self.allocator.free(self.req_to_token.table[req.req_pool_idx, first:end].clone())

    def _alloc_kv(
        self, alloc: Callable[[], torch.Tensor | None], tokens_needed: Callable[[], int]
    ) -> torch.Tensor | None:
        """``alloc()``; when it fails, evict cache for the missing part of ``tokens_needed()``
        (fresh pages, in tokens) and try once more."""
        slots = alloc()
        if slots is None:
            self.cache.evict(tokens_needed() - self.allocator.available())
            slots = alloc()
        return slots

    def _alloc_decode_slots(self, decodes: list[Req]) -> bool:
        """A slot each for the next position of ``decodes``, written into the table at once."""
        table = self.req_to_token.table
        rows = torch.tensor([r.req_pool_idx for r in decodes], dtype=torch.int64)
        lens = torch.tensor([r.kv_len for r in decodes], dtype=torch.int64)
        slots = self._alloc_kv(
            lambda: self.allocator.alloc_decode(table, rows, lens),
            lambda: self.allocator.tokens_needed_decode(lens),
        )
        if slots is None:
            return False
        self.req_to_token.write_points(rows, lens, slots)  # one indexed write (hot path)
        return True

    def _alloc_extend(self, row: int, kv_len: int, num_tokens: int) -> bool:
        """Slots for positions kv_len.. of table row ``row``, written into the row."""
        table_row = self.req_to_token.table[row]
        slots = self._alloc_kv(
            lambda: self.allocator.alloc_extend(table_row, kv_len, num_tokens),
            lambda: self.allocator.tokens_needed(kv_len, num_tokens),
        )
        if slots is None:
            return False
        self.req_to_token.write(row, kv_len, slots)
        return True

    def alloc_positions(self, req: Req, start: int, num_tokens: int, evict: bool = True) -> bool:
        """Slots for positions start.. of running ``req``'s row (evicting cache if needed,
        and ``evict``); False when the pool cannot give them."""
        assert req.req_pool_idx is not None
        if evict:
            return self._alloc_extend(req.req_pool_idx, start, num_tokens)
        row = self.req_to_token.table[req.req_pool_idx]
        slots = self.allocator.alloc_extend(row, start, num_tokens)
        if slots is None:
            return False
        self.req_to_token.write(req.req_pool_idx, start, slots)
        return True

    def reserve_prompt(self, req: Req, held: int) -> torch.Tensor | None:
        """A table row and slots (whole pages) for the prompt of ``req``, whose KV arrives
        from elsewhere, while the running limit (counting ``held`` requests reserved so far)
        and the KV pool allow (evicting cache if needed); the slots, or None."""
        if len(self.running) + held >= self.config.max_running_requests:
            return None
        n = len(req.input_ids)
        row = self.req_to_token.alloc()
        if row is None:
            return None
        slots = self._alloc_kv(
            lambda: self.allocator.alloc(n), lambda: self.allocator.tokens_needed(0, n)
        )
        if slots is None:
            self.req_to_token.free(row)
            return None
        self.req_to_token.write(row, 0, slots)
        req.req_pool_idx = row
        return slots

    def free_reserved(self, req: Req) -> None:
        """Give back what ``reserve_prompt`` gave ``req`` (its KV never arrived)."""
        if req.req_pool_idx is None:
            return
        table = self.req_to_token
        self.allocator.free(table.table[req.req_pool_idx, : len(req.input_ids)].clone())
        table.free(req.req_pool_idx)
        req.req_pool_idx = None

    def release(self, req: Req) -> None:
        """Give back a finished ``req``'s KV and row, and drop it from the running requests."""
        self._release(req)

    def _release(self, req: Req) -> None:
        """Give back ``req``'s KV (computed tokens go to the cache) and its table row."""
        if req.req_pool_idx is not None:
            for strategy in self.strategies:
                strategy.on_release(self, req)
            self._cache_of(req).cache_finished_req(req)
            self.req_to_token.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.kv_len = 0
        req.num_pending = 0
        for strategy in self.strategies:
            strategy.released(req)
        if req in self.running:
            self.running.remove(req)

    def _cache_of(self, req: Req) -> RadixCache | NoPrefixCache:
        return self.cache if req.pooling is None else self._uncached

    def kv_accounting(self) -> dict[str, int]:
        free = self.allocator.available()
        evictable, locked = self.cache.evictable_size, self.cache.locked_size
        return {
            "size": self.allocator.size,
            "free": free,
            "evictable": evictable,
            "locked": locked,  # by running requests and by pins (``pinned``)
            "pinned": sum(s.pinned_tokens() for s in self.strategies),
            "in_use": self.allocator.size - free - evictable - locked,
        }

    def check_no_leak(self) -> None:
        """At idle every slot is free or held by the cache, and only pins (open sessions)
        lock cache nodes; raise AssertionError otherwise."""
        acct = self.kv_accounting()
        if not self.running and acct["in_use"] != 0:
            raise AssertionError(f"KV leak at idle: {acct}")
        if not self.running and acct["locked"] != acct["pinned"]:
            raise AssertionError(f"cache nodes still locked at idle beyond pins: {acct}")
        self.cache.check_tiers()
