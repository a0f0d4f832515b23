"""Scheduler: admission, a per-step token budget, chunked prefill, policies and retraction.

One step is ``plan -> execute -> commit``: ``schedule`` returns the step's plan (plain data,
core/step_plan.py), the model runner executes it, ``advance`` and ``commit`` take its result
(core/step_commit.py). Decodes go first (one token each), then prefill chunks fill the rest
of the token budget, so a long prompt never stalls running decodes. Under KV pressure the
scheduler evicts cache, then retracts the newest running requests (their tokens are
recomputed later; greedy output does not change).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

from radixserve.core.admission import Admission
from radixserve.core.grammar import GrammarStepper
from radixserve.core.interfaces import StepStrategy
from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.core.priority import PriorityPolicy
from radixserve.core.radix_cache import NoPrefixCache, RadixCache
from radixserve.core.request import FinishReason, Req, ReqState
from radixserve.core.schedule_policy import prefill_budget
from radixserve.core.step_commit import StepCommit
from radixserve.core.step_plan import Extra, SchedulerStats, StepPlan, step_kind
from radixserve.core.step_plan import RetractionNeeded as RetractionNeeded
from radixserve.core.step_plan import SchedulerConfig as SchedulerConfig
from radixserve.core.stop import StopChecker
from radixserve.core.strategy_list import StrategyList

logger = logging.getLogger(__name__)


class Scheduler(StepCommit, Admission):
    """Plans each step (core/step_plan.py): decodes, strategies' extra rows, prefill chunks
    and admissions within the token budget; retracts under KV pressure."""

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: TokenAllocator,
        req_to_token: ReqToTokenPool,
        cache: RadixCache | NoPrefixCache,
        stop_checker: StopChecker,
        grammar: GrammarStepper | None = None,
        strategies: Sequence[StepStrategy] = (),
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.cache = cache
        # Embedding requests neither read nor fill the prefix cache (core/pooling.py).
        self._uncached = NoPrefixCache(allocator, req_to_token)
        # While paused (a weight update waits for the running requests), nothing is admitted.
        self.paused = False
        self.stop_checker = stop_checker
        self.grammar = grammar or GrammarStepper(stop_checker.tokenizer, jump_forward=False)
        # the enabled step strategies (core/interfaces.py): extra rows, commit, release
        self.strategies = StrategyList(strategies)
        self.waiting: deque[Req] = deque()
        # Requests ended outside any batch (the KV pool cannot hold them); see pop_ended().
        self.ended: list[Req] = []
        self.running: list[Req] = []
        # The waiting request this step's admission stopped at (it could not get KV); None
        # when admission did not run or stopped for another reason. With nothing running it can
        # never fit (``end_unschedulable`` ends it, not another one).
        self.blocked: Req | None = None
        self.stats = SchedulerStats()
        # the waiting queue's rank order, retraction for rank, victims (core/priority.py)
        self.priority = PriorityPolicy(
            config.enable_priority_scheduling,
            config.schedule_low_priority_values_first,
            config.priority_aging_steps,
        )
        self._rng = random.Random(config.random_seed)
        self.trace_steps = False
        self.new_token_ratio = config.init_new_token_ratio
        self._ratio_decay = (config.init_new_token_ratio - config.min_new_token_ratio) / max(
            config.new_token_ratio_decay_steps, 1
        )
        self._retracted_this_step = False
        self._held_steps = 0  # steps in a row admission has waited for more arrivals
        self._scheduled: dict[str, int] = {}  # rid -> tokens given KV slots for this step
        # During admission: the running requests' KV reserve and those still prefilling, taken
        # once a step and kept up to date per admitted request (recomputed per admission, they
        # cost O(running) each, paid on every arrival by a server with hundreds running).
        self._reserved = 0.0
        self._prefilling: list[Req] = []

    # -- queue -----------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        self.priority.arrived(req)
        self.waiting.append(req)

    def add_running(self, req: Req) -> None:
        """Run ``req`` as a decode: its table row holds the KV of ``req.kv_len`` positions and
        its last token is appended (its KV came from a prefill server). One that already
        finished is released at once."""
        self.running.append(req)
        self._cache_of(req).cache_unfinished_req(req)
        if req.finished:
            self._release(req)

    def abort(self, rid: str, message: str = "aborted by the client") -> Req | None:
        """Abort ``rid`` in any state, freeing its KV; return it, or None if unknown."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish(FinishReason("abort", message=message))
                return req
        for req in self.running:
            if req.rid == rid:
                self._release(req)
                req.finish(FinishReason("abort", message=message))
                return req
        return None

    def pop_ended(self) -> list[Req]:
        """Requests the scheduler finished on its own since the last call (they are in no
        batch, so the engine must report them separately, or their clients would wait)."""
        ended, self.ended = self.ended, []
        return ended

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def end_unschedulable(self) -> list[Req]:
        """Nothing could run although requests wait: the one admission stopped at can never
        fit (nothing runs to free KV); end it. Not the oldest: the policy may have tried a
        larger one first (lpm), and the oldest may fit once that one is gone."""
        req = self.blocked
        if req is None or self.running or self.paused or all(r is not req for r in self.waiting):
            return []
        self.abort(req.rid, "the request does not fit in the KV pool")
        return [req]

    # -- one step --------------------------------------------------------------------------

    def schedule(self, allow_retract: bool = True) -> StepPlan | None:
        """The next step's batch, or None when nothing can run. With ``allow_retract=False``
        (tokens are pending) it raises RetractionNeeded where it would have to retract.

        Progress is guaranteed: when every running request is a prefill that cannot get KV,
        the newest is retracted (or, alone, ended with a reason), so a step never comes back
        empty while requests run."""
        self.blocked = None
        self._scheduled = {}
        self.priority.preempt(self, allow_retract)  # room for a higher rank that waits
        if not self.config.mixed_chunk:
            alone = self._schedule_prefill_alone()
            if alone is not None:
                return alone
        self._retracted_this_step = False
        self._scheduled = {}
        while True:
            decodes = self._schedule_decodes(allow_retract)
            config = self.config
            budget = prefill_budget(
                config.chunked_prefill_size, len(decodes), config.prefill_shrink_after_decodes
            )
            extra = self._extend(decodes) if decodes else {}
            budget -= sum(len(e.tokens) for e in extra.values())
            prefills, budget = self._extend_running_prefills(budget)
            if decodes or prefills or not self._stalled():
                self._scheduled = {r.rid: 1 for r in decodes}
                self._scheduled.update((r.rid, n) for r, n in prefills)
                break
            if not allow_retract:
                raise RetractionNeeded
            self._unstall()
        # A request retracted this step would only be re-admitted into the same shortage.
        if self._retracted_this_step:
            self.blocked = None  # it may fit once the retraction's KV is back
        if budget > 0 and self.waiting and not self._retracted_this_step and not self.paused:
            if not self._gathering(bool(decodes) and not prefills, budget):
                prefills += self._admit(budget)
        if not self._retracted_this_step:
            self.new_token_ratio = max(
                self.new_token_ratio - self._ratio_decay, self.config.min_new_token_ratio
            )
        if not decodes and not prefills:
            return None
        return self._plan(decodes, prefills, extra)

    def _extend(self, decodes: list[Req]) -> dict[str, Extra]:
        """The strategies' extra rows for this step's decodes (rid -> rows)."""
        extra: dict[str, Extra] = {}
        for strategy in self.strategies.on.extend_plan:
            extra.update(strategy.extend_plan(self, decodes))
        return extra

    def _plan(
        self, decodes: list[Req], prefills: list[tuple[Req, int]], extra: dict[str, Extra]
    ) -> StepPlan:
        """The plan: single-token extends attend like decodes, so they join the batched
        decode path; entries with extra rows go with the extends, or, where those rows attend
        as decodes, right after the decodes."""
        if not prefills and not extra:  # decodes only, in order (the hot path: no sorting)
            n = len(decodes)
            return StepPlan(decodes, [1] * n, n, {}, self._count_step(n, 0))
        decode_entries = [
            (r, 1 + len(extra[r.rid].tokens) if r.rid in extra else 1) for r in decodes
        ]
        entries = sorted(decode_entries + prefills, key=lambda e: _entry_order(e, extra))
        num_decode = sum(1 for _, n in entries if n == 1)
        kind = self._count_step(len(decodes), sum(n for _, n in prefills))
        by_index = {
            i: extra[r.rid]
            for i, (r, _) in enumerate(entries)
            if r.rid in extra and r.state == ReqState.DECODE
        }
        return StepPlan(
            [r for r, _ in entries], [n for _, n in entries], num_decode, by_index, kind
        )

    def _schedule_prefill_alone(self) -> StepPlan | None:
        """Without mixing: a step of prefill chunks only (running prefills, then admissions),
        or None when none can run now (the mixed path then schedules the decodes, and retracts
        where it must)."""
        self._retracted_this_step = False
        prefills, budget = self._extend_running_prefills(
            prefill_budget(self.config.chunked_prefill_size, 0)
        )
        self._scheduled = dict((r.rid, n) for r, n in prefills)
        if budget > 0 and self.waiting and not self.paused:
            prefills += self._admit(budget)
        if not prefills:
            return None
        self.new_token_ratio = max(
            self.new_token_ratio - self._ratio_decay, self.config.min_new_token_ratio
        )
        entries = sorted(prefills, key=lambda e: e[1] != 1)  # single-token extends first
        kind = self._count_step(0, sum(n for _, n in prefills))
        num_decode = sum(1 for _, n in entries if n == 1)
        reqs, lens = [r for r, _ in entries], [n for _, n in entries]
        return StepPlan(reqs, lens, num_decode, kind=kind)

    def _count_step(self, num_decodes: int, prefill_tokens: int) -> str:
        """Count a scheduled step under its kind (and trace it when asked); return the kind."""
        kind = step_kind(num_decodes, prefill_tokens)
        counted = self.stats.by_kind[kind]
        counted.steps += 1
        counted.decodes += num_decodes
        counted.prefill_tokens += prefill_tokens
        if self.trace_steps:
            self.stats.step_trace.append((num_decodes, prefill_tokens))
        return kind

    def _stalled(self) -> bool:
        """Requests run, yet none could get KV for its next tokens (only prefills remain)."""
        return any(r.state == ReqState.PREFILL and r.kv_len < r.seq_len for r in self.running)

    def _unstall(self) -> None:
        """Free KV for the stalled prefills: retract the newest running request, or end the
        only one, which the pool cannot hold even with the cache evicted."""
        victim = self.priority.victim(self.running)
        if len(self.running) > 1:
            self._retract(victim)
            return
        self._release(victim)
        victim.finish(FinishReason("abort", message="KV pool too small for this request"))
        self.ended.append(victim)

    def _schedule_decodes(self, allow_retract: bool) -> list[Req]:
        # A request whose pending token ends it (length) gets no step: it finishes at commit.
        max_context = self.config.max_context
        decodes = [
            r
            for r in self.running
            if r.state == ReqState.DECODE
            and r.num_output_tokens < r.sampling.max_new_tokens
            and r.seq_len < max_context
        ]
        while decodes:
            if self._alloc_decode_slots(decodes):
                return decodes
            if not allow_retract:
                raise RetractionNeeded
            # The newest running request (of the lowest rank) goes, mid-prefill ones included:
            # their KV counts too.
            victim = self.priority.victim(self.running)
            if victim in decodes:
                decodes.remove(victim)
            if len(self.running) > 1:
                self._retract(victim)
            else:
                self._release(victim)
                victim.finish(FinishReason("abort", message="KV pool too small for this request"))
                self.ended.append(victim)
        return decodes

    def _retract(self, req: Req) -> None:
        logger.debug("retracting %s under KV pressure", req.rid)
        self.retract(req)
        self._retracted_this_step = True
        self.new_token_ratio = self._ratio_after_retraction()

    def retract(self, req: Req, preempted: bool = False) -> None:
        """Give back running ``req``'s KV and queue it again (its tokens are recomputed);
        ``preempted``: for a waiting request of a higher rank (core/priority.py), before the
        step is planned, so admission still runs in this step."""
        self._release(req)
        req.state = ReqState.WAITING
        req.num_retractions += 1
        self.stats.retractions += 1
        self.stats.preemptions += preempted
        self.waiting.appendleft(req)

    def _ratio_after_retraction(self) -> float:
        """The share of their remaining budgets that running requests have shown to use: what
        they decoded so far, plus a margin of steps, over what they may decode in all."""
        decoded = sum(r.num_output_tokens for r in self.running)
        allowed = sum(r.sampling.max_new_tokens for r in self.running)
        estimate = (decoded + _RETRACT_MARGIN_STEPS * len(self.running)) / (allowed + 1)
        if not self.config.init_new_token_ratio:
            return 0.0  # --schedule-conservativeness 0: admission keeps nothing back
        return min(1.0, max(estimate, self.config.init_new_token_ratio))

    def _extend_running_prefills(self, budget: int) -> tuple[list[tuple[Req, int]], int]:
        """The next chunks of the running prefills, in order, within ``budget``: the
        (request, chunk) pairs that got KV, and the budget left."""
        prefills: list[tuple[Req, int]] = []
        for req in [r for r in self.running if r.state == ReqState.PREFILL]:
            chunk = self._extend_running(req, budget)
            if chunk:
                prefills.append((req, chunk))
                budget -= chunk
        return prefills, budget

    def _extend_running(self, req: Req, budget: int) -> int:
        chunk = min(req.seq_len - req.kv_len, budget)
        if chunk <= 0:
            return 0
        assert req.req_pool_idx is not None
        return chunk if self._alloc_extend(req.req_pool_idx, req.kv_len, chunk) else 0


def _entry_order(entry: tuple[Req, int], extra: dict[str, Extra]) -> int:
    """Decodes first, then entries whose extra rows attend as decodes, then extends."""
    req, n = entry
    if n == 1:
        return 0
    rows = extra.get(req.rid)
    return 1 if rows is not None and rows.decode_rows else 2


def new_token_ratios(conservativeness: float) -> dict[str, Any]:
    """SchedulerConfig's new-token ratios for ``--schedule-conservativeness`` (as SGLang)."""
    init = min(0.7 * conservativeness, 1.0)
    return {"init_new_token_ratio": init, "min_new_token_ratio": init * 0.14}


# After a retraction, running requests are assumed to decode this many more steps each.
_RETRACT_MARGIN_STEPS = 20
