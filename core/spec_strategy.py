"""Speculative decoding as a step strategy (core/interfaces.py, ``StepStrategy``): drafting
(chains and trees) with KV slots for the drafts, the verify rows of a step, accepting and
rolling back KV at commit, the device-side loop (core/spec_loop.py), step timing and the
pause policy's inputs (core/speculative.py), and /server_info's speculative stats.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.interfaces import Draft, StepStrategy
from radixserve.core.request import Req, token_slice
from radixserve.core.spec_loop import SpecLoop
from radixserve.core.spec_tree import ancestors, follow, node_depths
from radixserve.core.spec_verify import verify_drafts
from radixserve.core.speculative import Speculator, may_speculate, speculating
from radixserve.core.step_rows import LogitsPlan, StepRows

if TYPE_CHECKING:
    from collections.abc import Iterator

    from radixserve.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

_NOTHING_SCORED = range(0)


def speculator_of(core: Any) -> Speculator | None:
    """The Speculator of an EngineCore's speculation strategy (None when off)."""
    strategy = speculation_of(core)
    return strategy.speculator if strategy is not None else None


def speculation_of(core: Any) -> Speculation | None:
    return next((s for s in core.strategies if isinstance(s, Speculation)), None)


def is_reference_step(plan: Any, overlapped: bool, overlap: bool) -> bool:
    """Whether a step measures a verify step or plain decoding for the speculation policy:
    only decodes (and verifies); with the overlap schedule, a decode-only step counts only
    when it overlapped the step before, as decoding does while no request drafts (one
    launched alone after a verify step costs the host's work on top)."""
    if len(plan.reqs) != plan.num_decode + len(plan.extra):
        return False
    return bool(plan.extra) or overlapped or not overlap


class Speculation(StepStrategy):
    """Speculative decoding: the core's side of a speculative plugin, at the step's fixed
    points. Rolling back: a verify entry keeps exactly the KV of the positions its kept
    tokens follow; the slots of its other draft positions are freed at commit."""

    def __init__(
        self,
        speculator: Speculator,
        runner: Any,  # the ModelRunner (which imports this module)
        max_context: int,
        overlap: bool,
        host: Any = None,
    ) -> None:
        self.speculator = speculator
        self.runner = runner
        self.max_context = max_context
        self.overlap = overlap
        self.host = host
        self.loop: SpecLoop | None = None
        # Pad token-only drafts to the step's full draft length, and give paused requests
        # filler drafts while others speculate, so that a verify step keeps one shape: set
        # where the step executor replays verify graphs of one length (a ragged or mixed step
        # runs eagerly, on an H200 ~30 ms against ~3 ms for the default model at batch 8:
        # bench/spec_steps.py).
        self.uniform = False
        # paused requests verifying filler only this step (uniform): not judged, not counted
        # in the accept statistics, so their pause runs its course
        self.filler_only: set[str] = set()
        self._drafted_last: frozenset[str] = frozenset()  # requests that drafted last step
        self._real: dict[str, int] = {}  # this step's draft lengths before any padding

    # -- lifecycle ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.loop is not None and self.loop.active

    def drain(self, scheduler: Any) -> list[Any]:
        return self.loop.stop() if self.has_work() else []  # type: ignore[union-attr]

    def close(self) -> None:
        self.loop = None  # it holds the plugin's cycle graphs
        self.speculator.close()

    def spec_stats(self) -> dict[str, object] | None:
        sp = self.speculator
        return {
            "algorithm": sp.name,
            "num_draft_tokens": sp.num_draft,
            "disable_batch_size": sp.disable_batch_size,
            "simulated_accept_len": sp.simulate_accept_len,
            "adaptive": sp.adaptive is not None,
            **sp.stats.to_json(),
        }

    # -- the loop ------------------------------------------------------------------------------

    def needs_host_tokens(self, scheduler: Any) -> bool:
        """Whether the next step may draft for a running request, which needs its last token
        on the host."""
        sp, running = self.speculator, scheduler.running
        return sp.draft_length(len(running)) > 0 and any(sp.may_draft(r) for r in running)

    def run_own_step(self, scheduler: Any, hold: bool) -> tuple[list[Any], bool]:
        """One cycle of the device-side loop: stop it where it cannot go on, start it where
        it can, and launch a cycle while it runs."""
        loop = self.loop
        if loop is None:
            return [], False
        if loop.active and (hold or not loop.can_continue()):
            return loop.stop(), False
        if not loop.active:
            reqs = None if hold else loop.eligible()
            if reqs is None:
                return [], False
            try:
                if not loop.start(reqs):
                    return [], False
            except Exception as e:  # noqa: BLE001 - a failing request must not end the engine
                return self._fail_loop(scheduler, e), True
        start = time.perf_counter()
        try:
            changed = loop.advance()
        except Exception as e:  # noqa: BLE001
            return self._fail_loop(scheduler, e), True
        if self.host is not None:
            self.host.hook.step_finished(
                stats={
                    "num_decode": len(loop.reqs),
                    "num_prefill_tokens": 0,
                    "num_running": len(scheduler.running),
                    "num_waiting": len(scheduler.waiting),
                    "step_time_s": time.perf_counter() - start,
                }
            )
        return changed, True

    def _fail_loop(self, scheduler: Scheduler, error: Exception) -> list[Req]:
        """The loop's cycle raised: its requests end with an abort naming the error, as a
        failing step's do."""
        assert self.loop is not None
        reqs = self.loop.abandon()
        logger.error(
            "a speculative cycle of %d requests failed: %r; aborting them", len(reqs), error
        )
        message = f"the engine failed on this request's step ({type(error).__name__}: {error})"
        changed = []
        for req in reqs:
            if scheduler.abort(req.rid, message) is not None:
                req.failed = message
                changed.append(req)
        scheduler.cache.evict(1 << 62)
        return changed

    def step_done(self, plan: Any, seconds: float, overlapped: bool) -> None:
        """What speculation costs against plain decoding, per step from its planning
        (drafting included) or, overlapped, the last result."""
        drafted = frozenset(plan.reqs[i].rid for i in plan.extra)
        catching_up = not drafted <= self._drafted_last
        self._drafted_last = drafted
        if is_reference_step(plan, overlapped, self.overlap):
            rows = sum(len(d.tokens) for d in plan.extra.values())
            self.speculator.observe_step(
                bool(plan.extra), len(plan.reqs), seconds, catching_up=catching_up, draft_rows=rows
            )

    # -- the scheduler ---------------------------------------------------------------------

    def extend_plan(self, scheduler: Any, decodes: list[Any]) -> dict[str, Draft]:
        """Drafts for the decodes that speculate this step, with KV slots for their positions
        (allocated here, before proposing, so a draft model can write its own KV there)."""
        k = self.speculator.draft_length(len(decodes))
        if not k:
            return {}
        picked, paused = self._drafting(scheduler, decodes, k)
        if not picked:
            return {}
        reqs = [r for r, _, _, _ in picked]
        limits = [n for _, n, _, _ in picked]
        slots = [s for _, _, _, s in picked]
        drafts = self._propose(reqs, limits, [t for _, _, t, _ in picked])
        self._real.update((r.rid, len(d.tokens)) for r, d in zip(reqs, drafts, strict=True))
        if self.uniform:
            self.filler_only.clear()
            for req, limit in paused:  # they verify filler only: the step keeps one shape
                if _alloc_draft_slots(scheduler, req, limit):
                    reqs.append(req)
                    limits.append(limit)
                    slots.append(limit)
                    drafts.append(Draft([]))
                    self.filler_only.add(req.rid)
            drafts = [_padded(r, n, d) for r, n, d in zip(reqs, limits, drafts, strict=True)]
        out = {}
        for req, allocated, draft in zip(reqs, slots, drafts, strict=True):
            m = len(draft.tokens)
            scheduler.free_positions(req, req.kv_len + 1 + m, req.kv_len + 1 + allocated)
            if m:
                out[req.rid] = draft
        return out

    def _drafting(
        self, scheduler: Any, decodes: list[Req], k: int
    ) -> tuple[list[tuple[Req, int, int, int]], list[tuple[Req, int]]]:
        """The decodes that draft (request, limit, tree nodes, slots allocated) and, with
        uniform drafts, the paused ones (request, limit)."""
        sp = self.speculator
        picked: list[tuple[Req, int, int, int]] = []
        paused: list[tuple[Req, int]] = []
        lengths = self._adaptive_lengths(decodes)
        drafting = (
            sum(1 for r in decodes if speculating(r) and sp.may_draft(r)) if sp.tree_nodes else 0
        )
        for req in decodes:
            left = self.max_context - req.seq_len
            if not self.uniform:
                left = min(left, req.sampling.max_new_tokens - req.num_output_tokens)
            # With uniform drafts a request near its token budget drafts the full length all
            # the same (what it emits past the budget is cut at commit): one shorter draft
            # made the whole step's verify uneven, and such a step runs eagerly (~20 ms of
            # host time for the default model on an H200, against ~1 ms from a graph).
            limit = min(k if lengths is None else lengths.get(req.rid, 0), left - 1)
            # wants() first: a paused request's pause counts every step, also one whose last
            # token is still on the device (overlap scheduling)
            wants = sp.wants(req)
            if limit <= 0 or not speculating(req):
                continue
            if not wants:
                if self.uniform:
                    paused.append((req, limit))
                continue
            tree = sp.tree_nodes_for(req, drafting)
            if tree and sp.adaptive is not None:
                tree = sp.adaptive.tree_nodes_for(req.rid, limit)
            if tree and req.seq_len + tree >= self.max_context:
                tree = 0
            if _alloc_draft_slots(scheduler, req, max(limit, tree)):
                picked.append((req, limit, tree, max(limit, tree)))
        return picked, paused

    def _adaptive_lengths(self, decodes: list[Req]) -> dict[str, int] | None:
        """Adaptive drafting's length for each decode that may draft (None: not adaptive).
        Requests whose last token is still on the device are planned too, so that their
        idle steps count towards a probe (core/spec_adaptive.py)."""
        adaptive = self.speculator.adaptive
        if adaptive is None:
            return None
        rids = [r.rid for r in decodes if may_speculate(r)]
        return adaptive.plan(rids, len(decodes), self.uniform) if rids else {}

    def _propose(self, reqs: list[Req], limits: list[int], nodes: list[int]) -> list[Draft]:
        sp = self.speculator
        try:
            if any(nodes):
                return sp.propose(reqs, limits, nodes)
            return sp.propose(reqs, limits)
        except Exception:  # noqa: BLE001 - a failing drafter must not take the engine down
            logger.exception("speculative plugin '%s' failed to propose", sp.name)
            return [Draft([]) for _ in reqs]

    def before_commit(self, scheduler: Any, req: Any, extra: Draft, tokens: list[Any]) -> None:
        """A tree's accepted nodes: their slots move to positions kv_len + 1 .. in path order
        and every other node's slot after them, so that keeping a prefix of the positions
        keeps the path."""
        if extra.parents is None:
            return
        assert req.req_pool_idx is not None
        path = follow(extra.tokens, extra.parents, [t for t, _, _ in tokens])
        if path == list(range(len(path))):
            return  # the path already holds the first positions
        first = req.kv_len - len(extra.tokens)  # position kv_len + 1 before the step
        table = scheduler.req_to_token
        slots = table.table[req.req_pool_idx][first : first + len(extra.tokens)].clone()
        on_path = set(path)
        order = path + [j for j in range(len(slots)) if j not in on_path]
        table.write(req.req_pool_idx, first, slots[order])

    def committed(self, plan: Any, outcomes: list[tuple[Any, Draft, int, int]]) -> None:
        verified = []
        for req, draft, emitted, kept in outcomes:
            if req.rid in self.filler_only:
                continue
            gain = _draft_gain(draft)
            if kept < emitted:  # cut by a stop or the token budget (uniform drafts draft
                gain = min(gain, kept - 1)  # past it): count what was kept
            verified.append((req, gain, kept - 1))
            if self.speculator.adaptive is not None:  # what it drafted itself, not padding
                real = min(self._real.pop(req.rid, gain), gain)
                self.speculator.adaptive.observed(req.rid, real, min(kept - 1, real))
        if verified:
            reqs, drafted, accepted = zip(*verified, strict=True)
            self.speculator.verified(reqs, drafted, accepted, len(plan.reqs))

    def released(self, req: Any) -> None:
        self._real.pop(req.rid, None)
        self.speculator.algorithm.release(req.rid)
        self.speculator.forget(req.rid)

    # -- the model runner ------------------------------------------------------------------

    def add_rows(self, rows: Any, index: int, req: Any, n: int, extra: Draft) -> bool:
        """A verify entry: the last token, then the draft; a tree as decode rows."""
        if extra.parents is not None:
            self._add_tree(rows, index, req, extra)
            return True
        start = req.kv_len
        rows.input_ids += token_slice(req.input_ids, req.output_ids, start, 1) + extra.tokens
        if extra.pending is not None:
            at = len(rows.positions)
            rows.device_dst += range(at + 1, at + n)
            rows.device_tokens.append(extra.pending)
        offset = rows.add_sequence(req, n)
        first = len(rows.logits_rows)
        # every new token's logits: row j verifies draft token j
        rows.logits_rows += range(offset + start, offset + start + n)
        rows.plans.append(LogitsPlan(_NOTHING_SCORED, first, len(rows.logits_rows) - 1))
        return True

    def _add_tree(self, rows: StepRows, index: int, req: Req, draft: Draft) -> None:
        """The root and every node as a decode row (core/spec_tree.py)."""
        first = len(rows.logits_rows)
        tokens = token_slice(req.input_ids, req.output_ids, req.kv_len, 1) + draft.tokens
        if not rows.as_decodes:  # the step's first tree: scratch rows from the first
            self._scratch = iter(self.runner.scratch_rows)
        node_rows = self._tree_node_rows(req, draft, self._scratch)
        for (r, p), token in zip(node_rows, tokens, strict=True):
            rows.input_ids.append(token)
            rows.add_decode_row(r, p)
        rows.as_decodes[index] = len(node_rows)
        rows.plans.append(LogitsPlan(_NOTHING_SCORED, first, len(rows.logits_rows) - 1))

    def _tree_node_rows(
        self, req: Req, draft: Draft, scratch: Iterator[int]
    ) -> list[tuple[int, int]]:
        """(slot-table row, position) of a tree verify's decode rows: the root on the
        request's own row, then each node on a scratch row holding the request's prefix, the
        node's ancestors and the node (whose slot is that of position kv_len + 1 + j)."""
        assert draft.parents is not None and req.req_pool_idx is not None
        own, start = req.req_pool_idx, req.kv_len
        pool = self.runner.req_to_token
        prefix = pool.table[own, : start + 1]
        node_slots = pool.table[own, start + 1 : start + 1 + len(draft.tokens)]
        out = [(own, start)]
        for j in range(len(draft.tokens)):
            path = ancestors(draft.parents, j)
            row = next(scratch)
            pool.write(row, 0, torch.cat([prefix, node_slots[path]]))
            out.append((row, start + len(path)))
        return out

    def before_forward(self, batch: ForwardBatch) -> None:
        layers = self.speculator.algorithm.capture_hidden_layers
        if layers:
            batch.capture_hidden_layers = layers

    def after_forward(self, batch: ForwardBatch) -> None:
        if not batch.capture_hidden_layers or batch.hidden_consumed:
            return
        if batch.hidden_states is None:
            names = self.runner.plugins.names
            raise RuntimeError(
                f"model plugin '{names['model']}' keeps no hidden states "
                "(ForwardBatch.capture_hidden_layers), which the speculative plugin "
                f"'{names['speculative']}' needs"
            )
        self.speculator.algorithm.target_hidden(batch)

    def sample_rows(
        self, logits: torch.Tensor, plan: Any, plans: list[Any], sample: list[int], eos: Any
    ) -> dict[int, Any] | None:
        """Sample a step with verify entries: each sampled entry's rows (one for a plain
        entry, 1 + len(draft) for a verify entry) go through ``speculative.verify``; a verify
        entry gets the list of tokens it emits, a plain entry its one token."""
        if not plan.extra:
            return None
        reqs: list[Any] = []
        drafts: list[Draft | None] = []
        rows: list[int] = []
        for i in sample:
            draft = plan.extra.get(i)
            last = plans[i].sample_row
            rows += range(last - (len(draft.tokens) if draft is not None else 0), last + 1)
            reqs.append(plan.reqs[i])
            drafts.append(draft)
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[rows]  # (every row, in order, is the common case: no copy)
        masker = self.runner.grammar_masker
        emitted = verify_drafts(logits, reqs, drafts, eos, masker, self.speculator)
        return {
            i: tokens if i in plan.extra else tokens[0]
            for i, tokens in zip(sample, emitted, strict=True)
        }


def _alloc_draft_slots(scheduler: Any, req: Req, limit: int) -> bool:
    """KV slots for ``limit`` draft positions after ``req``'s decode slot (the decode slot
    of position kv_len is already allocated); False when the pool has no room (the request
    then decodes normally). No cache is evicted for drafts."""
    return scheduler.alloc_positions(req, req.kv_len + 1, limit, evict=False)


def _draft_gain(draft: Draft) -> int:
    """The most draft tokens a verify of ``draft`` can accept: a chain's length, a tree's
    depth."""
    if draft.parents is None:
        return len(draft.tokens)
    return max(node_depths(draft.parents), default=0)


def _padded(req: Req, limit: int, draft: Draft) -> Draft:
    """``draft`` filled up to ``limit`` tokens, so that every request of the step verifies as
    many (a captured verify graph has one length). The filler repeats the last token: the
    target verifies it like any draft, and accepts it only where it is the target's own token,
    so outputs do not change. Left alone: drafts drawn from a distribution (rejection sampling
    needs its probabilities), drafts still on the device (full length already) and constrained
    requests (their drafts must stay inside the grammar)."""
    missing = limit - len(draft.tokens)
    if missing <= 0 or draft.probs is not None or draft.pending is not None or req.grammar:
        return draft
    if draft.parents is not None:  # a tree verifies as decode rows, in no verify graph
        return draft
    last = draft.tokens[-1] if draft.tokens else (req.output_ids or req.input_ids)[-1]
    return Draft(draft.tokens + [last] * missing)


def loop_of(core: Any) -> SpecLoop | None:
    """The device-side loop of an EngineCore's speculation strategy (None when it has none)."""
    strategy = speculation_of(core)
    return strategy.loop if strategy is not None else None
