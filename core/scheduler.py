"""Scheduler: admission, a per-step token budget, chunked prefill, policies and retraction.

One step is ``schedule -> run batch -> process output``. Decodes go first (one token each),
then prefill chunks fill the rest of the token budget, so a long prompt never stalls running
decodes. Under KV pressure the scheduler evicts cache, then retracts the newest running
requests (their tokens are recomputed later; greedy output does not change).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.core.grammar import GrammarStepper
from radixserve.core.interfaces import StepStrategy
from radixserve.core.logprobs import first_scored_position
from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.core.radix_cache import NoPrefixCache, RadixCache
from radixserve.core.request import FinishReason, Req, ReqState, token_slice
from radixserve.core.schedule_policy import order_waiting, prefill_budget
from radixserve.core.step_plan import Extra, SampledToken, SchedulerStats, StepPlan, step_kind
from radixserve.core.step_plan import RetractionNeeded as RetractionNeeded
from radixserve.core.step_plan import ScheduledBatch as ScheduledBatch
from radixserve.core.stop import StopChecker, TopLogprobs

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int  # -1: no chunking
    schedule_policy: str
    max_context: int
    random_seed: int = 0
    # Admission reserves room for the running requests' future tokens: this share of what each
    # may still generate. It starts at init, decays to min while nothing is retracted, and jumps
    # back up after a retraction (SGLang's new_token_ratio).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.098
    new_token_ratio_decay_steps: int = 600
    # False: a step with prefill work runs it alone and the decodes wait a step (SGLang's
    # default; a decode-only step can replay a CUDA graph, a mixed one runs eagerly).
    mixed_chunk: bool = True
    # Past this many decodes in a step, its prefill tokens shrink in proportion (0: never;
    # schedule_policy.prefill_budget).
    prefill_shrink_after_decodes: int = 0
    # While decodes run and the waiting prompts would fill under the step's prefill budget,
    # admission waits up to this many steps (0: never) and at most prefill_gather_max_wait_s
    # after the oldest waiting request arrived, so that arrivals trickling in one by one share
    # one mixed step instead of making each step mixed (a decode-only step replays a CUDA
    # graph; a mixed one runs eagerly).
    prefill_gather_steps: int = 0
    prefill_gather_max_wait_s: float = 0.05
    # Requests whose uncached prompt shares at least this many tokens with one being prefilled
    # wait for that prefill to reach the cache instead of computing the same KV again.
    shared_prefill_min_tokens: int = 32


class Scheduler:
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
        self.strategies = list(strategies)
        self.waiting: deque[Req] = deque()
        # Requests ended outside any batch (the KV pool cannot hold them); see pop_ended().
        self.ended: list[Req] = []
        self.running: list[Req] = []
        # The waiting request this step's admission stopped at (it could not get KV); None
        # when admission did not run or stopped for another reason. With nothing running it can
        # never fit (EngineCore._fail_unschedulable ends it, not another one).
        self.blocked: Req | None = None
        self.stats = SchedulerStats()
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
        # Called with a request whose slots are about to be released (a prefill server sends
        # their KV then; core/disaggregation.py).
        self.on_release: Callable[[Req], None] | None = None

    # -- queue -----------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
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

    # -- one step --------------------------------------------------------------------------

    def schedule(self, allow_retract: bool = True) -> StepPlan | None:
        """The next step's batch, or None when nothing can run. With ``allow_retract=False``
        (tokens are pending) it raises RetractionNeeded where it would have to retract.

        Progress is guaranteed: when every running request is a prefill that cannot get KV,
        the newest is retracted (or, alone, ended with a reason), so a step never comes back
        empty while requests run."""
        self.blocked = None
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
        for strategy in self.strategies:
            extra.update(strategy.extend_plan(self, decodes))
        return extra

    def _plan(
        self, decodes: list[Req], prefills: list[tuple[Req, int]], extra: dict[str, Extra]
    ) -> StepPlan:
        """The plan: single-token extends attend like decodes, so they join the batched
        decode path; entries with extra rows go with the extends, or, where those rows attend
        as decodes, right after the decodes."""
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
        victim = max(self.running, key=lambda r: r.arrival_time)
        if len(self.running) > 1:
            self._retract(victim)
            return
        self._release(victim)
        victim.finish(FinishReason("abort", message="KV pool too small for this request"))
        self.ended.append(victim)

    def process_output(self, batch: StepPlan, sampled: dict[int, SampledToken]) -> list[Req]:
        """Advance requests after a forward; ``sampled`` maps batch index -> (token id,
        logprob, top logprobs).
        Returns the requests that produced a token or finished this step."""
        self.advance(batch)
        return self.commit(batch, sampled)

    def advance(self, batch: StepPlan) -> None:
        """The bookkeeping of a launched step that needs no sampled token: KV lengths, prompt
        sharing, states. Each request that samples gets one pending token until ``commit``,
        so the next step can be scheduled while the device still computes this one."""
        self.stats.steps += 1
        sample_row = 0  # rows of the step's sampled ids, in batch order
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            req.kv_len += n
            if i in batch.extra:  # commit keeps the positions of kept tokens, frees the rest
                req.num_pending += 1
                req.pending_row = sample_row
                sample_row += 1
                continue
            if req.kv_len < req.seq_len:
                self._cache_of(req).cache_unfinished_req(req)  # chunked prefill goes on
                continue
            if req.state == ReqState.PREFILL:
                self._cache_of(req).cache_unfinished_req(req)  # share the prompt while it decodes
            if req.sampling.max_new_tokens > 0:
                req.state = ReqState.DECODE
                req.num_pending += 1
                req.pending_row = sample_row
                sample_row += 1

    def commit(self, batch: StepPlan, sampled: dict[int, SampledToken]) -> list[Req]:
        """Append ``batch``'s sampled tokens (after ``advance``) and finish what must finish.
        Requests that ended since the step was launched (a stop found one step late) are
        skipped: their token for this step is discarded.
        Returns the requests that produced a token or finished."""
        changed: list[Req] = []
        outcomes: list[tuple[Req, Extra, int, int]] = []
        for i, req in enumerate(batch.reqs):
            if req.finished:
                continue
            token = sampled.get(i)
            if i in batch.extra:
                assert isinstance(token, list), "an entry with extra rows samples a list"
                extra = batch.extra[i]
                for strategy in self.strategies:
                    strategy.before_commit(self, req, extra, token)
                kept = self._commit_tokens(req, batch.extend_lens[i], token)
                outcomes.append((req, extra, len(token), kept))
            elif token is not None:
                req.num_pending -= 1
                self._append_sampled(req, *token)
            elif req.sampling.max_new_tokens == 0 and req.kv_len >= req.seq_len:
                req.finish(FinishReason("length", length=0))
            else:
                assert req.kv_len < req.seq_len, f"{req} reached its end but sampled nothing"
                continue  # a prefill chunk; the prompt continues next step
            if req.finished:
                self._release(req)
            changed.append(req)
        if outcomes:
            for strategy in self.strategies:
                strategy.committed(batch, outcomes)
        return changed

    def _commit_tokens(self, req: Req, n: int, tokens: list[SampledToken]) -> int:
        """Append an extended entry's emitted tokens in order, up to a stop (or a grammar's
        jump-forward), keep the KV of the positions they follow and free the rest. Returns
        how many tokens were appended."""
        start = req.kv_len - n  # the position of the step's first input (the last token)
        req.num_pending -= 1
        committed = 0
        for token in tokens:
            self._append_sampled(req, *token)
            committed += 1
            if req.finished or req.state == ReqState.PREFILL:
                break
        req.kv_len = start + committed
        self.free_positions(req, req.kv_len, start + n)
        return committed

    def append_received(
        self, req: Req, token: int, lp: float | None, top: TopLogprobs | None
    ) -> None:
        """Append a token sampled elsewhere (a prefill server's first token, under the
        request's grammar if it has one) as if sampled here: grammar, stops, jump-forward."""
        self._append_sampled(req, token, lp, top)

    def _append_sampled(
        self, req: Req, token: int, lp: float | None, top: TopLogprobs | None
    ) -> None:
        if req.grammar is not None and not self.grammar.accept(req, token):
            return  # finished with an abort naming the grammar problem
        self.stop_checker.append(req, token, lp, top)
        done = req.grammar is None or req.finished
        forced = [] if done else self.grammar.after_token(req)
        for t in forced:  # jump-forward: the next step extends over these tokens
            self.stop_checker.append(req, t)
            if req.finished:
                return
        if forced:
            req.state = ReqState.PREFILL

    def needs_sampling(self, batch: StepPlan) -> list[int]:
        """Batch indices whose forward reaches the end of their tokens and must sample."""
        return [
            i
            for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True))
            if (req.kv_len + n == req.seq_len or i in batch.extra)
            and req.sampling.max_new_tokens > 0
        ]

    def free_positions(self, req: Req, keep: int, end: int) -> None:
        """Give back the slots of positions [keep, end) of ``req``'s row, except those in the
        page that also holds position keep - 1 (the request keeps writing into it)."""
        assert req.req_pool_idx is not None
        p = self.allocator.page_size
        first = -(-keep // p) * p
        if first < end:
            self.allocator.free(self.req_to_token.table[req.req_pool_idx, first:end].clone())

    # -- decodes and KV pressure -----------------------------------------------------------

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
            # The newest running request goes, mid-prefill ones included: their KV counts too.
            victim = max(self.running, key=lambda r: r.arrival_time)
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
        self._release(req)
        req.state = ReqState.WAITING
        req.num_retractions += 1
        self.stats.retractions += 1
        self.waiting.appendleft(req)
        self._retracted_this_step = True
        self.new_token_ratio = self._ratio_after_retraction()

    def _ratio_after_retraction(self) -> float:
        """The share of their remaining budgets that running requests have shown to use: what
        they decoded so far, plus a margin of steps, over what they may decode in all."""
        decoded = sum(r.num_output_tokens for r in self.running)
        allowed = sum(r.sampling.max_new_tokens for r in self.running)
        estimate = (decoded + _RETRACT_MARGIN_STEPS * len(self.running)) / (allowed + 1)
        if not self.config.init_new_token_ratio:
            return 0.0  # --schedule-conservativeness 0: admission keeps nothing back
        return min(1.0, max(estimate, self.config.init_new_token_ratio))

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

    def release(self, req: Req) -> None:
        """Give back a finished ``req``'s KV and row, and drop it from the running requests."""
        self._release(req)

    def _release(self, req: Req) -> None:
        """Give back ``req``'s KV (computed tokens go to the cache) and its table row."""
        if req.req_pool_idx is not None:
            if self.on_release is not None:
                self.on_release(req)
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

    # -- prefill ---------------------------------------------------------------------------

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

    def _admit(self, budget: int) -> list[tuple[Req, int]]:
        # The tree's matched lengths cannot change during admission (no insert happens; a split
        # keeps lengths), so each waiting request is peeked at most once per step.
        peeked: dict[str, tuple[int, object]] = {}

        def peek(r: Req) -> tuple[int, object]:
            if r.rid not in peeked:
                key = r.fill_ids()[: _match_limit(r)]
                peeked[r.rid] = self.cache.peek_prefix(key, r.extra_key)
            return peeked[r.rid]

        admitted: list[tuple[Req, int]] = []
        self._reserved = sum(self._reserve_of(r) for r in self.running)
        self._prefilling = [
            r for r in self.running if r.state == ReqState.PREFILL and r.pooling is None
        ]
        ordered = order_waiting(self.config.schedule_policy, list(self.waiting), peek, self._rng)  # type: ignore[arg-type]
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if self._shares_running_prefill(req, peek):
                self.stats.deferred_admissions += 1
                continue
            chunk = self._admit_one(req, budget)
            if chunk == 0:
                self.blocked = req
                break
            self.waiting.remove(req)
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
        limit = _match_limit(req)
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
        prefix, node = cache.match_prefix(fill[: _match_limit(req)], req.extra_key)
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

    # -- accounting ------------------------------------------------------------------------

    def kv_accounting(self) -> dict[str, int]:
        free = self.allocator.available()
        evictable, locked = self.cache.evictable_size, self.cache.locked_size
        return {
            "size": self.allocator.size,
            "free": free,
            "evictable": evictable,
            "locked": locked,
            "in_use": self.allocator.size - free - evictable - locked,
        }

    def check_no_leak(self) -> None:
        """At idle every slot is free or held by the cache; raise AssertionError otherwise."""
        acct = self.kv_accounting()
        if not self.running and acct["in_use"] != 0:
            raise AssertionError(f"KV leak at idle: {acct}")
        if not self.running and acct["locked"] != 0:
            raise AssertionError(f"cache nodes still locked at idle: {acct}")


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


def _match_limit(req: Req) -> int:
    """How many leading tokens may come from the cache: never the last one (its logits are
    needed), and none whose logits input-logprob scoring still needs."""
    if req.pooling is not None:
        return 0  # embeddings use no cached prefix (core/pooling.py)
    limit = req.seq_len - 1
    scored_from = first_scored_position(req)
    return limit if scored_from is None else min(limit, scored_from)
