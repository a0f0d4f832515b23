"""Speculation with the whole cycle on the device: the host runs one cycle behind.

A speculative step done the plain way is host-bound on a fast GPU with a small model: the host
reads the verify's tokens, accepts, stages the next proposal and launches it while the device
waits (on an H200 with the default model, a step took ~3 ms against ~1.5 ms of device work).

Here a speculative plugin offers a ``DeviceCycle``: propose, run the target over the last token
and the drafts (``DeviceVerify``), accept greedily and advance, all from state that stays on the
device (each request's length and recent tokens), so the host can queue cycle c + 1 before it
has read cycle c. The loop then goes: launch a cycle, commit the one before it (append its
tokens, check stops), repeat. What the host needs ahead of the device, it gets ahead:
- KV slots: a cycle adds at most k + 1 positions, so the positions up to the committed length
  + 2(k + 1) have slots before each launch (the in-flight cycle's and the next one's).
- Stops: found one cycle late. A request that finished drops the later cycle's tokens; the
  KV that cycle wrote past its end is freed with its slots.

The loop runs while it can: every running request decodes greedily with nothing that needs the
host between tokens (no grammar, penalties, logit bias, logprobs or pending min-tokens), there
are at most ``DeviceCycle.max_batch`` of them, the speculation policy has paused none of them
(``_pays``; while looping it judges them as one, ``_judge``), and no request waits. Anything
else (an arrival, an abort, a finish, a full pool) drains it: the cycle in flight is
committed, the slots past each request's end are freed, and the usual scheduler takes over
from a state it knows (``stop``).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.core.batch import ForwardBatch, prepare_from_device
from radixserve.core.interfaces import DeviceCycle, TargetVerify
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.request import Req, ReqState

#: The most requests the loop takes: past a few, a step's device time grows with the batch and
#: the host's work hides behind it anyway (and on CUDA speculation is cut off above 4).
LOOP_BATCH = 4
#: Host steps the loop's requests pause after it stopped for not paying: the first pause,
#: doubling up to the most while its episodes (a start to the next stop) keep not paying.
FIRST_PAUSE, MAX_PAUSE = 4, 64
#: The least deficit (tokens a request, see ``SpecLoop._judge``) that stops the loop, and how
#: many recent restarts price a stop.
MIN_DEFICIT, RESTARTS = 2.0, 8


class DeviceVerify(TargetVerify):
    """The target's forward over verify rows given as device tensors only, which a speculative
    cycle captured in one CUDA graph runs: ``q_len`` rows per request at positions
    ``seq_lens - q_len ..``, their K/V written at ``slots``, each row's logits returned. The
    speculative plugin's ``target_hidden`` runs on the kept layers, as after any forward."""

    def __init__(
        self,
        model: Any,
        attention: Any,
        kv_pool: Any,
        req_to_token: ReqToTokenPool,
        capture_layers: tuple[int, ...],
        consumer: Callable[[ForwardBatch], None] | None,
    ) -> None:
        self.model, self.attention, self.kv_pool = model, attention, kv_pool
        self.req_to_token = req_to_token
        self.capture_layers = capture_layers
        self.consumer = consumer

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        q_len: int,
    ) -> torch.Tensor:
        bs, n = rows.shape[0], ids.shape[0]
        batch = ForwardBatch(
            input_ids=ids,
            positions=positions,
            out_cache_loc=slots,
            # host-side, as in the verify graphs (prepare_from_device fills it where read)
            req_pool_indices=torch.full((bs,), self.req_to_token.pad_row, dtype=torch.int64),
            req_to_token=self.req_to_token.table,
            seq_lens=[q_len] * bs,
            extend_lens=[q_len] * bs,
            num_decode=0,
            logits_indices=torch.arange(n, device=ids.device),
            kv_pool=self.kv_pool,
            req_to_token_pool=self.req_to_token,
            capture_hidden_layers=self.capture_layers,
        )
        batch = prepare_from_device(self.attention, batch, rows, seq_lens, q_len)
        logits = self.model.forward(batch)
        if self.capture_layers and self.consumer is not None:
            self.consumer(batch)
        return logits


def loops_greedily(req: Req) -> bool:
    """Whether ``req``'s next tokens can come from the device cycle: it decodes greedily and
    nothing about a token needs the host before the next (a grammar, penalties, logit bias,
    logprobs, a min-tokens mask still on, scoring of its input)."""
    s = req.sampling
    return (
        req.state == ReqState.DECODE
        and req.num_pending == 0
        and s.is_greedy
        and req.overlappable
        and not s.logit_bias
        and req.num_output_tokens >= s.min_new_tokens
        and req.label_token_ids is None
    )


class SpecLoop:
    """The host's side of device speculation: when to loop, slots ahead, committing cycles."""

    def __init__(
        self,
        cycle: DeviceCycle,
        scheduler: Any,  # core.scheduler.Scheduler
        speculator: Any,  # core.speculative.Speculator
        max_context: int,
    ) -> None:
        self.cycle = cycle
        self.scheduler = scheduler
        self.speculator = speculator
        self.max_context = max_context
        self.q = cycle.k + 1
        self.reqs: list[Req] = []
        self._in_flight: Callable[[], list[list[int]]] | None = None
        self._slot_end: dict[str, int] = {}  # positions [kv_len, end) have slots ahead
        self._trusted: dict[str, int] = {}  # draft KV the last committed cycle left, per request
        self._last_commit_at = 0.0
        self.cycles = 0  # cycles launched (tests and benchmarks read it)
        self.loops = 0  # times the loop started
        self.verdicts = 0  # times it stopped for not paying
        # The policy's state (``_judge``): the running deficit and the episode's net gain, in
        # tokens a request; the next pause; the seconds recent starts took.
        self._deficit = self._episode = 0.0
        self._pause = FIRST_PAUSE
        self._restarts: deque[float] = deque(maxlen=RESTARTS)

    @property
    def active(self) -> bool:
        return bool(self.reqs)

    def _fits(self, req: Req) -> bool:
        return (
            loops_greedily(req)
            and req.num_output_tokens < req.sampling.max_new_tokens
            and req.kv_len >= self.q
            and req.seq_len + 2 * self.q + 1 < self.max_context
        )

    def _pays(self, reqs: Sequence[Req]) -> bool:
        """Whether none of ``reqs`` is paused: the loop judges its requests as one
        (``_judge``) and pauses them together, and a request the plain path paused holds the
        loop off until its pause ends."""
        sp = self.speculator
        if sp.adaptive is not None and not sp.adaptive.pays_at(
            [r.rid for r in reqs], len(reqs), self.cycle.k
        ):
            return False
        return all(sp.may_draft(r) for r in reqs)

    def _judge(self, reqs: Sequence[Req], accepted: Sequence[int]) -> None:
        """The policy's verdict after a cycle, on its requests as one. The loop drafts for all
        of them or none: at these batch sizes a verify row costs next to nothing beside the
        launch-bound forward (on the H200, a verify of 5 rows took 0.95 ms against 0.87 for a
        decode), so what counts is the batch's mean gain g (tokens a request a cycle) against
        the break-even b = cycle time / decode step time, both measured at this batch size.

        A cycle with g < b loses (b - g) decode steps of time; the loop stops once the losses
        since its last good stretch (a CUSUM: max(0, d + b - g)) outweigh what a restart costs
        (its catch-up, measured, in decode steps; at least MIN_DEFICIT). So a few poor cycles
        in a stretch that pays (JSON: values the head misses between keys it drafts well) do
        not stop it: judged per request and per cycle, the pauses and restarts cost JSON at
        batch 1 12% on the H200 (1.47x against 1.68x without pauses). A stop pauses the
        requests together, FIRST_PAUSE steps after an episode that paid as a whole, else a
        pause doubling up to MAX_PAUSE: code edits at batch 4, paused one by one and
        restarted by whichever resumed first, restarted the loop every ~9 steps."""
        sp = self.speculator
        if not sp.pause_unprofitable or sp.adaptive is not None or not self._pays(reqs):
            return  # (paused already: the cycle in flight at a verdict is not judged again)
        if sp.probe_decode(reqs, len(self.reqs)):
            return
        decode, cycle = sp.step_time(False, len(self.reqs)), sp.step_time(True, len(self.reqs))
        if decode is None or cycle is None:
            return
        needed = cycle / decode
        gain = (len(accepted) + sum(accepted)) / len(accepted)
        self._episode += gain - needed
        self._deficit = max(0.0, self._deficit + needed - gain)
        if not self._deficit:
            sp.paying()  # no stale verdict holds the next arrival paused
            return
        restart = statistics.median(self._restarts) / decode if self._restarts else 0.0
        if self._deficit <= max(MIN_DEFICIT, restart):
            return
        if self._episode >= 0:
            steps, self._pause = FIRST_PAUSE, 2 * FIRST_PAUSE
        else:
            steps, self._pause = self._pause, min(2 * self._pause, MAX_PAUSE)
        sp.pause(reqs, steps)
        self.verdicts += 1

    def eligible(self) -> list[Req] | None:
        """The running requests, when the loop can take all of them now."""
        s = self.scheduler
        running = s.running
        if not running or len(running) > self.cycle.max_batch or s.waiting or s.paused:
            return None
        if self.speculator.draft_length(len(running)) < self.cycle.k:
            return None
        if not all(self._fits(r) for r in running) or not self._pays(running):
            return None
        return list(running)

    def can_continue(self) -> bool:
        """Whether the next cycle may be launched: the same requests still run, each still
        fits, drafting still pays for one of them, and nothing waits."""
        s = self.scheduler
        if s.waiting or s.paused or len(s.running) != len(self.reqs):
            return False
        if not all(not r.finished and r in s.running and self._fits(r) for r in self.reqs):
            return False
        return self._pays(self.reqs)

    def start(self, reqs: list[Req]) -> bool:
        """Begin looping over ``reqs`` (every running request, each with its last token on the
        host); False when their slots ahead cannot be had (nothing started)."""
        self.reqs = reqs
        self._slot_end = {r.rid: r.kv_len for r in reqs}
        self._trusted = {}
        if not self._ensure_slots():
            self._free_ahead(reqs)
            self.reqs = []
            return False
        began = time.perf_counter()
        self.cycle.begin(reqs)
        self.loops += 1
        self._last_commit_at = time.perf_counter()
        self._restarts.append(self._last_commit_at - began)
        self._deficit = self._episode = 0.0
        return True

    def advance(self) -> list[Req]:
        """Launch the next cycle, then commit the one before it. Returns the requests with new
        tokens or a finish."""
        if not self._ensure_slots():
            return self.stop()
        self.scheduler.req_to_token.sync()
        launched = self.cycle.launch()
        self.cycles += 1
        previous, self._in_flight = self._in_flight, launched
        return self._commit(previous()) if previous is not None else []

    def stop(self) -> list[Req]:
        """Drain: commit the cycle in flight, free every slot past a request's end, and hand the
        requests back to the scheduler with their drafter's record up to date."""
        changed: list[Req] = []
        if self._in_flight is not None:
            fetch, self._in_flight = self._in_flight, None
            changed = self._commit(fetch())
        live = self._still_running(self.reqs)
        self._free_ahead(live)
        if live:
            self.cycle.end(live, [self._trusted.get(r.rid, 0) for r in live])
        self.reqs = []
        return changed

    def abandon(self) -> list[Req]:
        """Give up on the loop without committing (its cycle failed): free the slots ahead and
        return the requests, whose committed state is as before the failed cycle."""
        self._in_flight = None
        live = self._still_running(self.reqs)
        self.reqs = []
        self._free_ahead(live)
        self._slot_end.clear()
        return live

    def _commit(self, emitted: list[list[int]]) -> list[Req]:
        """Append one cycle's tokens: per request, its candidates t0..tk and last the count a
        of accepted drafts, so t0..ta are its new tokens."""
        s = self.scheduler
        changed: list[Req] = []
        judged: list[tuple[Req, int, int]] = []  # (request, drafts counted, drafts kept)
        for req, row in zip(self.reqs, emitted, strict=True):
            if req.finished or req not in s.running:
                continue  # ended a cycle ago (or aborted): this cycle's tokens are dropped
            accepted = row[-1]
            start = req.kv_len
            committed = 0
            for token in row[: accepted + 1]:
                s.append_received(req, token, None, None)
                committed += 1
                if req.finished:
                    break
            req.kv_len = start + committed
            self._trusted[req.rid] = start  # the cycle's catch-up wrote draft KV up to here
            # a stop or the token budget may cut the accepted run: count what was kept (as the
            # scheduler's verify commit does), else the stats and the policy overrate the cycle
            kept = committed - 1
            judged.append((req, self.cycle.k if kept == accepted else kept, kept))
            if req.finished:
                s.free_positions(req, req.kv_len, self._slot_end.pop(req.rid))
                s.release(req)
            changed.append(req)
        now = time.perf_counter()
        if judged:
            reqs = [r for r, _, _ in judged]
            drafts = [m for _, m, _ in judged]
            counts = [a for _, _, a in judged]
            self.speculator.observe_step(
                True, len(self.reqs), now - self._last_commit_at,
                draft_rows=len(self.reqs) * self.cycle.k,
            )  # fmt: skip
            self.speculator.verified(reqs, drafts, counts, len(self.reqs), judge=False)
            if self.speculator.adaptive is not None:
                for req, m, a in judged:
                    self.speculator.adaptive.observed(req.rid, m, a)
            self._judge(reqs, counts)
        self._last_commit_at = now
        return changed

    def _ensure_slots(self) -> bool:
        """Slots for every position a launched cycle may write: up to the committed length +
        2(k + 1) (the cycle in flight and the next), allocated in runs of 4(k + 1)."""
        s = self.scheduler
        for req in self.reqs:
            if req.finished:
                continue
            end = self._slot_end[req.rid]
            if end >= req.kv_len + 2 * self.q:
                continue
            want = min(req.kv_len + 4 * self.q, self.max_context) - end
            if not s.alloc_positions(req, end, want):
                return False
            self._slot_end[req.rid] = end + want
        return True

    def _still_running(self, reqs: Sequence[Req]) -> list[Req]:
        """``reqs`` that neither finished nor left the scheduler (an abort) since they looped."""
        return [r for r in reqs if not r.finished and r in self.scheduler.running]

    def _free_ahead(self, reqs: Sequence[Req]) -> None:
        for req in reqs:
            end = self._slot_end.pop(req.rid, req.kv_len)
            if end > req.kv_len:
                self.scheduler.free_positions(req, req.kv_len, end)
