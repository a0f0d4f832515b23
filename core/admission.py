"""The scheduler's admission of waiting requests: the policy's order, prompts that share a
prefill still running, the KV reserve kept for running requests' future tokens, and
gathering arrivals into one mixed step. A base of ``core.scheduler.Scheduler``."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable

from radixserve.core.kv_slots import KVSlots
from radixserve.core.logprobs import first_scored_position
from radixserve.core.priority import PriorityPolicy
from radixserve.core.request import Req, ReqState, token_slice
from radixserve.core.schedule_policy import order_waiting
from radixserve.core.step_plan import SchedulerStats


class Admission(KVSlots):
    """Admitting waiting requests within a step's token budget."""

    waiting: deque[Req]
    paused: bool
    blocked: Req | None
    stats: SchedulerStats
    priority: PriorityPolicy
    new_token_ratio: float
    _rng: random.Random
    _held_steps: int
    _scheduled: dict[str, int]
    _reserved: float
    _prefilling: list[Req]

    def _gathering(self, decode_only: bool, budget: int) -> bool:
        """Whether this step's admission waits for more arrivals: the step would otherwise be
        decode-only, the waiting prompts fill under ``budget``, and neither the step bound nor
        the oldest waiting request's age bound has been reached."""
        config = self.config
        hold = (
            decode_only
            and self._held_steps < config.prefill_gather_steps
            and self._waiting_tokens_under(budget)
            and time.perf_counter() - min(r.arrival_time for r in self.waiting)
            < config.prefill_gather_max_wait_s
        )
        self._held_steps = self._held_steps + 1 if hold else 0
        self.stats.gathering_steps += hold
        return hold

    def _waiting_tokens_under(self, budget: int) -> bool:
        """Whether the waiting requests' tokens sum to less than ``budget`` (stops summing
        there: a long queue is not walked each step)."""
        total = 0
        for req in self.waiting:
            total += req.seq_len
            if total >= budget:
                return False
        return True

    def _admit(self, budget: int) -> list[tuple[Req, int]]:
        # The tree's matched lengths cannot change during admission (no insert happens; a split
        # keeps lengths), so each waiting request is peeked at most once per step.
        peeked: dict[str, tuple[int, object]] = {}

        def peek(r: Req) -> tuple[int, object]:
            if r.rid not in peeked:
                key = r.fill_ids()[: match_limit(r)]
                peeked[r.rid] = self.cache.peek_prefix(key, r.extra_key)
            return peeked[r.rid]

        admitted: list[tuple[Req, int]] = []
        self._reserved = self.kv_reserve()
        self._prefilling = [
            r for r in self.running if r.state == ReqState.PREFILL and r.pooling is None
        ]
        ordered = order_waiting(self.config.schedule_policy, list(self.waiting), peek, self._rng)  # type: ignore[arg-type]
        ordered = self.priority.order(ordered)
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if not all(s.admissible(req) for s in self.strategies):
                continue  # e.g. its LoRA adapter finds no free slot
            if self._shares_running_prefill(req, peek):
                self.stats.deferred_admissions += 1
                continue
            chunk = self._admit_one(req, budget)
            if chunk == 0:
                self.blocked = req
                break
            self.waiting.remove(req)
            self.priority.admitted(req)
            admitted.append((req, chunk))
            budget -= chunk
        return admitted

    def _shares_running_prefill(self, req: Req, peek: Callable[[Req], tuple[int, object]]) -> bool:
        """Whether ``req``'s uncached prompt starts like a prompt still being prefilled (an
        identical prompt sent together, a sibling of n>1): it then waits one step or more, and
        is admitted from the cache once that prefill has put the shared tokens there.
        ``peek(req)`` says how much of it the cache holds now."""
        prefilling = [r for r in self._prefilling if r.extra_key == req.extra_key]
        if not prefilling:
            return False
        limit = match_limit(req)
        cached = peek(req)[0]
        span = min(self.config.shared_prefill_min_tokens, limit - cached)
        span -= span % self.allocator.page_size
        if span <= 0:
            return False
        n = cached + span
        key = token_slice(req.input_ids, req.output_ids, 0, n)
        return any(token_slice(r.input_ids, r.output_ids, 0, n) == key for r in prefilling)

    def _admit_one(self, req: Req, budget: int) -> int:
        fill = req.fill_ids()
        cache = self._cache_of(req)
        prefix, node = cache.match_prefix(fill[: match_limit(req)], req.extra_key)
        chunk = min(len(fill) - len(prefix), budget)
        row = self.req_to_token.alloc()
        if row is None:
            return 0
        cache.inc_lock_ref(node)  # protect the matched prefix from our own eviction
        if self.running and not self._fits_with_reserve(req, len(fill) - len(prefix)):
            cache.dec_lock_ref(node)
            self.req_to_token.free(row)
            return 0
        self.req_to_token.write(row, 0, prefix)
        if not self._alloc_extend(row, len(prefix), chunk):
            cache.dec_lock_ref(node)
            self.req_to_token.free(row)
            return 0
        req.req_pool_idx, req.cache_node = row, node
        req.prefix_len = req.kv_len = len(prefix)
        if req.num_retractions == 0:
            req.cached_tokens = len(prefix)
            self.stats.prompt_tokens += len(fill)
            self.stats.cached_tokens += len(prefix)
        req.state = ReqState.PREFILL
        self.running.append(req)
        self._scheduled[req.rid] = chunk
        self._reserved += self._reserve_of(req)
        if req.pooling is None:
            self._prefilling.append(req)
        return chunk

    def would_fit(self, req: Req) -> bool:
        """Whether waiting ``req`` could be admitted now: the running limit, and its uncached
        prompt with its share of future tokens beside the running requests' reserve."""
        if len(self.running) >= self.config.max_running_requests:
            return False
        cached = self.cache.peek_prefix(req.fill_ids()[: match_limit(req)], req.extra_key)[0]
        reserved = self.kv_reserve()
        room = self.allocator.available() + self.cache.evictable_size - reserved
        need = req.seq_len - cached + self.new_token_ratio * self._remaining_new_tokens(req)
        return need <= room

    def kv_reserve(self) -> float:
        """KV slots the running requests may still take (unslotted prompts, their share of
        future tokens): free slots beyond it may hold prefixes for the waiting ones."""
        return sum(self._reserve_of(r) for r in self.running)

    def _fits_with_reserve(self, req: Req, uncached: int) -> bool:
        """Whether ``req``'s uncached prompt and its share of future tokens fit beside what the
        running requests still need (their unprefilled prompts and their share). Called with
        ``req``'s prefix locked, so the cache it shares is not counted as evictable."""
        room = self.allocator.available() + self.cache.evictable_size - self._reserved
        return uncached + self.new_token_ratio * self._remaining_new_tokens(req) <= room

    def _reserve_of(self, r: Req) -> float:
        """What running request ``r`` still needs: its prompt without slots yet, and its share
        of the tokens it may still generate."""
        unslotted = r.seq_len - r.kv_len - self._scheduled.get(r.rid, 0)
        return unslotted + self.new_token_ratio * self._remaining_new_tokens(r)

    def _remaining_new_tokens(self, req: Req) -> int:
        left = req.sampling.max_new_tokens - req.num_output_tokens
        return max(0, min(left, self.config.max_context - req.seq_len))


def match_limit(req: Req) -> int:
    """How many leading tokens may come from the cache: never the last one (its logits are
    needed), and none whose logits input-logprob scoring still needs."""
    if req.pooling is not None:
        return 0  # embeddings use no cached prefix (core/pooling.py)
    limit = req.seq_len - 1
    scored_from = first_scored_position(req)
    return limit if scored_from is None else min(limit, scored_from)
