"""Adaptive drafting (``--speculative-adaptive``): how many draft tokens each request proposes
this step, from its own recent acceptance and what a verify row costs at this batch size.

Pure policy, no tensors: the speculation strategy (core/spec_strategy.py) asks ``plan`` before
drafting, reports each verify's outcome (``observed``) and each step's time (``observe_step``).

The model. A request accepts each next draft token with probability ``p`` (tokens after a
rejected one are lost), so k drafts gain ``p + p^2 + .. + p^k`` tokens beyond the target's own.
``p`` is estimated from the request's verifies, decayed so that the newest count most:
accepted tokens are successes, a rejection (fewer accepted than drafted) one failure.

The cost. A step of B decodes carrying R draft rows takes ``t0 * (1 + c * R)``: ``t0`` is a
decode-only step at B's batch-size bucket, ``c`` the cost of one draft row (its verify and its
share of the drafting) relative to it, both medians of steps measured on-line per bucket.

The choice. The step's tokens over its time, ``(B + sum of gains) / (1 + c * R)``, grows with
one more draft row exactly while that row's expected gain ``p^j`` beats ``c`` times the step's
tokens per unit of time so far; the gains of a request fall with depth, so taking the best rows
first while they beat it is the optimum. A request whose ``p`` falls gets shorter drafts and
then none (within a few verifies), one that keeps accepting drafts the maximum, and at a batch
size where a row costs more than any request gains, nobody drafts: the fixed batch-size cut-off
falls out of the same model. A request that stopped drafting probes (a short draft) after a
number of steps that doubles while probes keep failing. Where every row of a step must be the
same length (captured verify graphs, ``uniform``), the same model decides per step whether all
its requests draft the full length (shorter drafts padded) or none: a graph serves one length.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

#: Weight kept of a request's older acceptance counts at each new verify (0.5: a request whose
#: drafts stop being accepted stops drafting within about five verifies).
DECAY = 0.5
#: The acceptance a request starts from (as pseudo-counts worth PRIOR_WEIGHT verifies), until
#: requests were observed; after that new requests start from the recent requests' mean.
PRIOR_P, PRIOR_WEIGHT = 0.6, 2.0
#: The highest acceptance estimate (a run of full accepts must not make deep drafts look free).
MAX_P = 0.95
#: A draft row's cost relative to a decode step until measured at a bucket (CPU float32: a
#: verify of 5 rows took ~1.8 decode steps, ~0.16 a row; a small model on a GPU: ~0.02).
PRIOR_ROW_COST = 0.1
#: Steps a request that stopped drafting waits before it probes, doubling up to the most.
FIRST_PROBE, MAX_PROBE = 4, 64
#: Draft tokens of a probe.
PROBE_DRAFT = 2
#: Step times kept per bucket and kind, whose median counts.
WINDOW = 15
#: Verify steps at a bucket after which, with no decode step measured there, the next
#: PROBE_STEPS steps draft nothing (a decode step must be measured for the cost model).
DECODE_PROBE_AFTER, PROBE_STEPS, MAX_DECODE_PROBES = 4, 3, 3


@dataclass(slots=True)
class _Req:
    accepted: float  # decayed successes
    rejected: float  # decayed failures
    idle: int = 0  # steps planned without a draft since it last drafted
    probe_every: int = FIRST_PROBE
    last_k: int = -1  # the last step's planned length (-1: not planned yet)

    @property
    def p(self) -> float:
        total = self.accepted + self.rejected
        return min(MAX_P, self.accepted / total) if total > 0 else PRIOR_P


def bucket(batch_size: int) -> int:
    """Batch sizes whose step times are kept together: powers of two."""
    return 1 << (max(batch_size, 1) - 1).bit_length()


def expected_gain(p: float, k: int) -> float:
    """Tokens k drafts gain beyond the target's own at per-token acceptance ``p``."""
    return sum(p**j for j in range(1, k + 1))


class AdaptiveDrafting:
    """Per-request draft lengths from acceptance and a measured per-row cost (module doc)."""

    def __init__(self, max_draft: int, tree_nodes: int = 0) -> None:
        self.max_draft = max_draft
        self.tree_nodes = tree_nodes  # a full tree's nodes (0: chains)
        self._reqs: dict[str, _Req] = {}
        self._decode: dict[int, deque[float]] = {}  # bucket -> decode-only step seconds
        self._row: dict[int, deque[float]] = {}  # bucket -> a row's cost / decode step
        self._verifies: dict[int, int] = {}  # bucket -> verify steps since a decode probe
        self._decode_probes: dict[int, int] = {}
        self._probing = 0  # steps left of a decode probe
        self._recent_p: deque[float] = deque(maxlen=16)  # finished requests' estimates
        self.steps_planned = 0

    # -- observations --------------------------------------------------------------------

    def observe_step(self, batch_size: int, draft_rows: int, seconds: float) -> None:
        """A step of ``batch_size`` decodes carrying ``draft_rows`` draft rows took this long
        (drafting included)."""
        b = bucket(batch_size)
        if draft_rows <= 0:
            self._decode.setdefault(b, deque(maxlen=WINDOW)).append(seconds)
            return
        self._verifies[b] = self._verifies.get(b, 0) + 1
        t0 = self.decode_time(batch_size)
        if t0 is None or t0 <= 0:
            return
        cost = max(0.0, (seconds - t0) / t0 / draft_rows)
        self._row.setdefault(b, deque(maxlen=WINDOW)).append(cost)

    def observed(self, rid: str, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` tokens of ``rid`` accepted ``accepted`` of them."""
        if drafted <= 0:
            return
        state = self._state(rid)
        accepted = min(accepted, drafted)
        state.accepted = DECAY * state.accepted + accepted
        state.rejected = DECAY * state.rejected + (1.0 if accepted < drafted else 0.0)
        if accepted:
            state.probe_every = FIRST_PROBE

    def forget(self, rid: str) -> None:
        state = self._reqs.pop(rid, None)
        if state is not None and state.accepted + state.rejected > 0:
            self._recent_p.append(state.p)

    # -- estimates -----------------------------------------------------------------------

    def accept_prob(self, rid: str) -> float:
        state = self._reqs.get(rid)
        return state.p if state is not None else self._start_p()

    def decode_time(self, batch_size: int) -> float | None:
        samples = self._decode.get(bucket(batch_size))
        return statistics.median(samples) if samples else None

    def row_cost(self, batch_size: int) -> float:
        """A draft row's cost at this batch size relative to a decode step."""
        samples = self._row.get(bucket(batch_size))
        return statistics.median(samples) if samples else PRIOR_ROW_COST

    def drafting(self, rid: str) -> bool:
        """Whether ``rid`` may draft next step: it drafted at its last plan, was never
        planned, or probes next (the host then needs its last token)."""
        state = self._reqs.get(rid)
        return state is None or state.last_k != 0 or state.idle + 1 >= state.probe_every

    # -- the choice ----------------------------------------------------------------------

    def plan(self, rids: Sequence[str], batch_size: int, uniform: bool = False) -> dict[str, int]:
        """Draft tokens for each of ``rids`` (the step's requests that may draft) in a step of
        ``batch_size`` decodes; ``uniform``: one length for all of them."""
        self.steps_planned += 1
        states = [self._state(r) for r in rids]
        if self._decode_probe_due(batch_size):
            lengths = [0] * len(rids)
        elif uniform:
            lengths = [self._uniform_length(states, batch_size)] * len(rids)
        else:
            lengths = self._allocate(states, batch_size)
        out = {}
        for rid, state, k in zip(rids, states, lengths, strict=True):
            k = self._probed(state, k)
            state.last_k = k
            out[rid] = k
        return out

    def pays_at(self, rids: Sequence[str], batch_size: int, k: int) -> bool:
        """Whether ``k`` drafts for every one of ``rids`` pay at this batch size: the device
        loop's test (its captured cycle has one length; below it the host path adapts)."""
        c = self.row_cost(batch_size)
        return all(expected_gain(self.accept_prob(r), k) > c * k for r in rids)

    def tree_nodes_for(self, rid: str, depth: int) -> int:
        """A tree's nodes for a draft of ``depth`` (0: a chain): wider where the request's
        next token is uncertain (a chain already accepts most where ``p`` is high)."""
        if not self.tree_nodes or depth <= 0:
            return 0
        width_max = max(1, self.tree_nodes // max(self.max_draft, 1))
        width = min(width_max, max(1, round((1.0 - self.accept_prob(rid)) * 2 * width_max)))
        return 0 if width <= 1 else min(self.tree_nodes, depth * width)

    def _allocate(self, states: Sequence[_Req], batch_size: int) -> list[int]:
        """Greedy: the best next row of any request while it raises tokens per unit time."""
        c = self.row_cost(batch_size)
        lengths = [0] * len(states)
        tokens, time = float(batch_size), 1.0
        while True:
            best, gain = -1, 0.0
            for i, state in enumerate(states):
                if lengths[i] < self.max_draft:
                    g = state.p ** (lengths[i] + 1)
                    if g > gain:
                        best, gain = i, g
            if best < 0 or gain * time <= c * tokens:
                return lengths
            lengths[best] += 1
            tokens += gain
            time += c

    def _uniform_length(self, states: Sequence[_Req], batch_size: int) -> int:
        """One length for every request of the step: the full length or none. A captured
        verify graph serves one draft length per batch size (plugins/hardware/cuda_graph.py),
        and a step of any other length runs eagerly (~10x the time on an H200), so the step
        drafts in full, requests that gain little verifying padding, or not at all."""
        c = self.row_cost(batch_size)
        k = self.max_draft
        gained = sum(expected_gain(s.p, k) for s in states)
        rows = max(len(states), 1) * k
        return k if batch_size + gained > batch_size * (1.0 + c * rows) else 0

    def _probed(self, state: _Req, k: int) -> int:
        """``k``, or a probe's short draft for a request idle long enough."""
        if k > 0:
            state.idle = 0
            return k
        if self._probing:
            return 0
        state.idle += 1
        if state.idle < state.probe_every:
            return 0
        state.idle = 0
        state.probe_every = min(2 * state.probe_every, MAX_PROBE)
        return min(PROBE_DRAFT, self.max_draft)

    def _decode_probe_due(self, batch_size: int) -> bool:
        """Whether this step drafts nothing so that a decode step of its bucket is measured
        (requests that always gain otherwise never leave one to measure)."""
        if self._probing:
            self._probing -= 1
            return True
        b = bucket(batch_size)
        if b in self._decode or self._verifies.get(b, 0) < DECODE_PROBE_AFTER:
            return False
        if self._decode_probes.get(b, 0) >= MAX_DECODE_PROBES:
            return False
        self._decode_probes[b] = self._decode_probes.get(b, 0) + 1
        self._verifies[b] = 0
        self._probing = PROBE_STEPS - 1
        return True

    def _state(self, rid: str) -> _Req:
        state = self._reqs.get(rid)
        if state is None:
            p = self._start_p()
            state = self._reqs[rid] = _Req(p * PRIOR_WEIGHT, (1.0 - p) * PRIOR_WEIGHT)
        return state

    def _start_p(self) -> float:
        return statistics.fmean(self._recent_p) if self._recent_p else PRIOR_P
