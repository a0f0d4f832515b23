"""Speculative decoding in the core: who speculates and how far, and checking the drafts a
plugin proposes. No algorithm lives here; drafts come from the plugin. Verifying them against
the target's logits is ``core/spec_verify.py``.
"""

from __future__ import annotations

import logging
import os
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.core import spec_tree
from radixserve.core.config import ConfigError
from radixserve.core.interfaces import Draft, SpeculativeAlgorithm
from radixserve.core.request import Req, ReqState
from radixserve.core.spec_adaptive import AdaptiveDrafting
from radixserve.core.spec_tree import tree_problem
from radixserve.core.spec_verify import read_pending

logger = logging.getLogger(__name__)

#: Batch size up to which every request drafts the full length; beyond it the length shrinks.
FULL_DRAFT_BATCH = 8
#: Smoothing of the per-request gain (weight of the newest observation).
_EMA = 0.3
#: Step times are the median of the last this many of their kind and batch size: a one-off
#: step (a kernel compiled for a new shape took 1.3 s on the H200, where verify steps take
#: ~2.5 ms) must not make speculation look unprofitable for the next hundred verify steps.
_STEP_WINDOW = 15
#: A request whose speculation does not pay is paused this many steps at first, doubling up to
#: the maximum while its drafting episodes (the verifies from a resume to the next pause) keep
#: not paying as a whole.
_FIRST_PAUSE, _MAX_PAUSE = 4, 64
#: The longest pause a new request starts with, inherited from the last request judged.
_INHERITED_PAUSE = 8
#: Times a batch size's requests pause for one step so that a decode-only step of that size is
#: measured, while none is: drafts that always gain 2+ tokens never pause otherwise, however
#: much more than two decode steps their verify costs (on an H200 the default model's verify
#: steps took 3.3x a decode step, and EAGLE-3 ran at half the speed of speculation off).
_DECODE_PROBES = 3
#: Steps a probe pauses: with the overlap schedule the first decode step after a verify step
#: runs alone (the verify's tokens were read first), and only the later ones show what
#: decoding costs when it overlaps the host (on an H200, ~1.0 ms a step for the default model
#: where one alone took ~1.5 ms, which let drafts gaining 2.1 tokens keep a 3 ms verify).
_PROBE_STEPS = 3


@dataclass(slots=True)
class _Payoff:
    """Whether speculation pays for one request: its smoothed tokens per verify step, and how
    long it is paused after it did not pay."""

    gain: float
    paused: int = 0
    pause: int = _FIRST_PAUSE
    retrying: bool = False  # its pause just ended: the next verify is a fresh trial
    # The drafting episode so far: tokens gained and verifies since it last resumed.
    episode_gained: int = 0
    episode_verifies: int = 0


@dataclass(slots=True)
class SpecStats:
    verify_steps: int = 0  # steps in which at least one request verified a draft
    verified: int = 0  # (request, step) pairs that verified a draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    trees: int = 0  # drafts that were trees (--speculative-eagle-topk > 1)

    @property
    def avg_accept_length(self) -> float:
        """Tokens a request gained per verify step: accepted drafts + the target's one."""
        return (self.verified + self.accepted_tokens) / self.verified if self.verified else 0.0

    def to_json(self) -> dict[str, float | int]:
        return {
            "verify_steps": self.verify_steps,
            "verified_requests": self.verified,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "avg_accept_length": round(self.avg_accept_length, 4),
            "trees": self.trees,
        }


class Speculator:
    """The core's side of speculation: policy, draft checking, accept statistics."""

    def __init__(
        self,
        algorithm: SpeculativeAlgorithm,
        name: str,
        num_draft: int,
        disable_batch_size: int,
        vocab_size: int,
        simulate_accept_len: float | None = None,
        seed: int = 0,
        pause_unprofitable: bool = True,
        tree_nodes: int = 0,
        adaptive: AdaptiveDrafting | None = None,
    ) -> None:
        """``num_draft``: a chain's length or a tree's depth; ``tree_nodes``: the nodes of a
        draft tree (0: chains only); ``adaptive``: per-request draft lengths from acceptance
        and measured costs (core/spec_adaptive.py) in place of the pause policy and the fixed
        batch-size cut-off."""
        if tree_nodes and not algorithm.drafts_trees:
            raise ConfigError(
                f"speculative plugin '{name}' drafts chains only; speculative_eagle_topk > 1 "
                "(draft trees) needs eagle or eagle3"
            )
        self.algorithm = algorithm
        self.adaptive = adaptive
        self.name = name
        self.num_draft = num_draft
        self.tree_nodes = tree_nodes
        self.disable_batch_size = disable_batch_size
        self.vocab_size = vocab_size
        env = os.environ.get("RADIXSERVE_SIMULATE_ACC_LEN")
        if simulate_accept_len is None and env:
            simulate_accept_len = float(env)
        self.simulate_accept_len = simulate_accept_len
        if simulate_accept_len is not None:
            logger.warning(
                "speculation simulates an accept length of %.2f: outputs are meaningless",
                simulate_accept_len,
            )
        self._rng = random.Random(seed)
        self._carry: dict[str, float] = {}  # each request's simulated rounding remainder
        self.stats = SpecStats()
        self._payoff: dict[str, _Payoff] = {}
        self.pause_unprofitable = pause_unprofitable
        # Recent seconds of pure decode and pure verify steps, per batch size class: their
        # ratio is what a verify step must gain to pay (measured, as it differs by device: a
        # CPU verifies 5 tokens at ~1.8x a decode, a GPU at ~1.0x).
        self._step_samples: dict[tuple[bool, int], deque[float]] = {}
        self._probes: dict[int, int] = {}  # batch size -> steps paused to measure its decode
        self._probe_step: int | None = None  # the verify step whose requests probe
        self._last_verdict: _Payoff | None = None  # the last request judged, as judged

    def close(self) -> None:
        """Let go of the algorithm and everything it holds on the device (draft weights, draft
        KV, feature pools, graphs); the settings and stats stay readable."""
        self.algorithm = None  # type: ignore[assignment]

    def wants(self, req: Req) -> bool:
        """Whether ``req`` should draft this step: not while it is paused for not paying."""
        payoff = self._payoff.get(req.rid)
        if payoff is None:
            payoff = self._inherited(req)
            if payoff is None:
                return True
        if payoff.paused <= 0:
            return True
        payoff.paused -= 1
        payoff.retrying = payoff.paused == 0
        return False

    def _inherited(self, req: Req) -> _Payoff | None:
        """A new request's payoff when the last judged one did not pay: it starts paused for
        half of that one's next pause, at most _INHERITED_PAUSE steps, and backs off from that
        one's pause if its first verify does not pay either. Requests of one workload gain
        alike, and each retry costs a verify step plus the drafter's catch-up (on an H200 an
        eager EAGLE-3 proposal after a pause took ~6 ms, a decode step 1 ms: fresh requests
        retrying from the first pause cost 14% of batch-1 throughput where speculation did
        not pay). The cap because unrelated requests follow each other too: JSON prompts
        after open chat ones, each starting paused for 32 steps, ran at 1.43x of speculation
        off on the CPU against 1.71x when they came first (2026-12-03)."""
        last = self._last_verdict
        if last is None or last.paused <= 0:
            return None
        paused = min(last.pause // 2, _INHERITED_PAUSE)
        payoff = _Payoff(last.gain, paused=paused, pause=last.pause)
        self._payoff[req.rid] = payoff
        return payoff

    def may_draft(self, req: Req) -> bool:
        """Whether ``req`` drafts in the next step if its last token is on the host by then
        (``wants`` without counting the step: a request in the prefill or paused does not)."""
        if not _decodes_without_prompt_logprobs(req):
            return False
        if self.adaptive is not None and not self.adaptive.drafting(req.rid):
            return False
        payoff = self._payoff.get(req.rid) or self._last_verdict
        return payoff is None or payoff.paused <= 0

    def forget(self, rid: str) -> None:
        if self.adaptive is not None:
            self.adaptive.forget(rid)
        self._payoff.pop(rid, None)
        self._carry.pop(rid, None)

    def observe_step(
        self,
        verify: bool,
        batch_size: int,
        seconds: float,
        catching_up: bool = False,
        draft_rows: int = 0,
    ) -> None:
        """A step with only decodes (or only decodes and verifies, ``verify``) took this long.
        ``catching_up``: a request of this verify step did not draft in the step before (its
        first draft, or its first after a pause), so its drafter caught up over more than the
        last verify's tokens. Such steps are not what drafting costs while it goes on, and are
        left out: on 2 AVX2 cores an EAGLE-3 verify cycle took ~50 ms drafting every step and
        60-90 ms after a pause, and counting those kept JSON prompts paused at 26 tok/s where
        drafting every step made 39 (speculation off: 26)."""
        if verify and catching_up:
            return
        if self.adaptive is not None:
            self.adaptive.observe_step(batch_size, draft_rows if verify else 0, seconds)
        key = (verify, size_class(batch_size))
        self._step_samples.setdefault(key, deque(maxlen=_STEP_WINDOW)).append(seconds)

    def step_time(self, verify: bool, batch_size: int) -> float | None:
        """Recent seconds of a verify (or plain decode) step at ``batch_size``'s size class."""
        samples = self._step_samples.get((verify, size_class(batch_size)))
        return statistics.median(samples) if samples else None

    def _break_even(self, batch_size: int) -> float | None:
        """Tokens a verify step must yield to beat decoding, once both were measured."""
        verify, decode = self.step_time(True, batch_size), self.step_time(False, batch_size)
        return None if verify is None or decode is None else verify / decode

    def _judge(self, req: Req, gained: int, drafted: int, batch_size: int) -> None:
        batch_size = size_class(batch_size)
        # With no decode step measured yet, a pause is what measures one.
        needed = self._break_even(batch_size) or 1.0 + 1e-9
        payoff = self._payoff.get(req.rid)
        if payoff is None:
            # Optimistic until shown otherwise: the smoothed gain starts at the most this
            # verify could gain, so a request pauses after several poor verifies, not after
            # its first (JSON answers open with a few tokens the head misses; paused at once,
            # each retry cost a catch-up and the doubling pause kept them off for good).
            payoff = self._payoff[req.rid] = _Payoff(float(drafted + 1))
        if payoff.retrying:
            # The first verify after a pause decides alone whether drafting resumes: the gain
            # that paused it belongs to text already behind (JSON alternates structure the
            # head drafts well with values it misses).
            payoff.gain = max(payoff.gain, needed)
            payoff.retrying = False
        payoff.gain += _EMA * (gained - payoff.gain)
        payoff.episode_gained += gained
        payoff.episode_verifies += 1
        if self.step_time(False, batch_size) is None and self._probe(batch_size):
            payoff.paused = max(payoff.paused, _PROBE_STEPS)
            return
        if payoff.gain < needed:
            # The pause's length is the whole episode's verdict, not the last verify's: one
            # that paid as a whole (JSON: structure the head drafts well, values it misses)
            # pauses briefly; one that did not doubles the pause. A request just below
            # break-even whose gains scatter (open chat: 1 to 5 tokens a verify) otherwise
            # had its pause reset by every lucky verify, and its retries, each with a
            # catch-up, cost 9-14% against speculation off on the CPU (2026-12-03).
            if payoff.episode_gained > needed * payoff.episode_verifies:
                payoff.paused, payoff.pause = _FIRST_PAUSE, 2 * _FIRST_PAUSE
            else:
                payoff.paused = payoff.pause
                payoff.pause = min(2 * payoff.pause, _MAX_PAUSE)
            payoff.episode_gained = payoff.episode_verifies = 0
        self._last_verdict = _Payoff(payoff.gain, payoff.paused, payoff.pause)

    def pause(self, reqs: Sequence[Req], steps: int, probe: bool = False) -> None:
        """Pause ``reqs`` together for ``steps`` steps: the device loop's verdict on them as
        one (core/spec_loop.py), so they resume together. A request arriving next inherits
        the pause as after a request's own verdict, unless it was a ``probe``."""
        for req in reqs:
            payoff = self._payoff.get(req.rid)
            if payoff is None:
                payoff = self._payoff[req.rid] = _Payoff(float(self.num_draft + 1))
            payoff.paused, payoff.retrying = max(payoff.paused, steps), False
            payoff.episode_gained = payoff.episode_verifies = 0
        if not probe:
            self._last_verdict = _Payoff(0.0, paused=steps, pause=steps)

    def paying(self) -> None:
        """The device loop found drafting paying for its requests: a request arriving next
        drafts from its start (as after a request's own verdict that paid)."""
        self._last_verdict = None

    def probe_decode(self, reqs: Sequence[Req], batch_size: int) -> bool:
        """Where no decode step of ``batch_size``'s class is measured yet and a probe is due,
        pause ``reqs`` for the probe's steps (see ``_probe``); whether they were."""
        if self.step_time(False, batch_size) is not None or not self._probe(size_class(batch_size)):
            return False
        self.pause(reqs, _PROBE_STEPS, probe=True)
        return True

    def _probe(self, batch_size: int) -> bool:
        """Whether this verify step's requests pause once so that the next step, decodes
        only, measures a decode step of ``batch_size`` (every request of the step pauses
        together; a size is probed at most _DECODE_PROBES times)."""
        step = self.stats.verify_steps
        if self._probe_step == step:
            return True
        if self._probes.get(batch_size, 0) >= _DECODE_PROBES:
            return False
        self._probes[batch_size] = self._probes.get(batch_size, 0) + 1
        self._probe_step = step
        return True

    def draft_length(self, batch_size: int) -> int:
        """Draft tokens per request for a step of ``batch_size`` decodes (0: do not speculate);
        adaptive, the most a request may draft (the cost model decides who drafts how far)."""
        if self.adaptive is not None:
            return self.num_draft
        if batch_size > self.disable_batch_size:
            return 0
        if batch_size <= FULL_DRAFT_BATCH:
            return self.num_draft
        return max(1, self.num_draft * FULL_DRAFT_BATCH // batch_size)

    def tree_nodes_for(self, req: Req, num_drafting: int) -> int:
        """The nodes ``req`` may draft as a tree this step (0: a chain): trees while at most
        spec_tree.TREE_BATCH requests draft, never under a grammar (its masks follow chains)."""
        if not self.tree_nodes or num_drafting > spec_tree.TREE_BATCH or req.grammar is not None:
            return 0
        return self.tree_nodes

    def propose(
        self, reqs: Sequence[Req], limits: Sequence[int], nodes: Sequence[int] | None = None
    ) -> list[Draft]:
        """Each request's checked draft: at most its limit, token ids in the vocabulary, and,
        for a constrained request, only tokens its grammar accepts (stopping before one that
        would end the grammar, which the target samples itself). ``nodes``: where above 0, the
        request may draft a tree of that many tokens and depth ``limits[i]``."""
        if nodes is not None and any(nodes):
            drafts = self.algorithm.propose_trees(reqs, limits, nodes)
        else:
            drafts = self.algorithm.propose(reqs, limits)
        if len(drafts) != len(reqs):
            raise RuntimeError(
                f"speculative plugin '{self.name}' returned {len(drafts)} drafts for "
                f"{len(reqs)} requests"
            )
        pairs = zip(reqs, drafts, strict=True)
        if any(d.pending is not None and r.grammar is not None for r, d in pairs):
            read_pending(drafts)  # a grammar checks the tokens themselves
        out = []
        for i, (req, limit, draft) in enumerate(zip(reqs, limits, drafts, strict=True)):
            if draft.parents is not None:
                out.append(self._checked_tree(draft, limit, nodes[i] if nodes else 0))
                continue
            if draft.pending is not None:
                # A draft model's argmax over the shared vocabulary: valid by construction.
                m = min(limit, len(draft.tokens))
                probs = draft.probs[:m] if draft.probs is not None else None
                out.append(Draft([0] * m, probs, draft.pending[:m]) if m else Draft([]))
                continue
            tokens = _valid_prefix(draft, limit, self.vocab_size)
            if tokens and req.grammar is not None:
                tokens = _grammar_prefix(req.grammar, tokens)
            probs = draft.probs[: len(tokens)] if draft.probs is not None and tokens else None
            out.append(Draft(tokens, probs))
        return out

    def _checked_tree(self, draft: Draft, depth: int, max_nodes: int) -> Draft:
        """``draft`` when it is a tree the verify step can take, else an empty draft."""
        assert draft.parents is not None
        tokens = draft.tokens
        problem = tree_problem(tokens, draft.parents, depth, max_nodes)
        if problem is None and not all(_is_token(t, self.vocab_size) for t in tokens):
            problem = f"a token outside the vocabulary [0, {self.vocab_size})"
        if problem is not None:
            logger.warning("speculative plugin '%s' drafted a bad tree: %s", self.name, problem)
            return Draft([])
        if not tokens:
            return Draft([])
        self.stats.trees += 1
        return Draft(list(tokens), None, None, list(draft.parents))

    def verified(
        self,
        reqs: Sequence[Req],
        drafted: Sequence[int],
        accepted: Sequence[int],
        batch_size: int,
        judge: bool = True,
    ) -> None:
        """Count a verify step's outcome; ``judge``: the policy judges each request on it (the
        device loop judges its requests as one instead, ``pause``)."""
        self.stats.verify_steps += 1
        for req, m, a in zip(reqs, drafted, accepted, strict=True):
            self.stats.verified += 1
            self.stats.draft_tokens += m
            self.stats.accepted_tokens += a
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += a
            req.spec_draft_tokens += m
            judged = judge and self.pause_unprofitable and self.adaptive is None
            if judged and self.simulate_accept_len is None:
                self._judge(req, a + 1, m, batch_size)
        self.algorithm.verified(reqs, accepted)

    def simulated(self, num_drafted: int, rid: str = "") -> int:
        """A count of accepted drafts for request ``rid`` (the simulated accept length minus
        one, the target's token, rounded down or up), capped by what was drafted. Each request
        carries its rounding remainder from draw to draw, from a seeded random start, so any
        run of its n draws sums to within one of n times the mean. Independent coin flips
        drift by sqrt(n) / 2: the ~90 draws of one batch-1 benchmark request at a mean of 2.5
        drafts averaged 2.35 with seed 0. Per request, so that requests progress alike: one
        remainder shared by a batch gives every other request the rounded-up count, always."""
        assert self.simulate_accept_len is not None
        mean = self.simulate_accept_len - 1.0
        low = int(mean)
        carried = self._carry.get(rid)
        if carried is None:
            carried = self._rng.random()
        carried += mean - low
        self._carry[rid] = carried - int(carried)
        return min(low + int(carried), num_drafted)


def size_class(batch_size: int) -> int:
    """The batch sizes whose step times the policy keeps apart: powers of two (a step of 5-8
    requests replays the same CUDA graph, and costs about the same on a CPU). Exact sizes split
    the measurements so thinly, as requests finish, that a size's decode step was often never
    measured and its verify steps went unjudged."""
    return 1 << (batch_size - 1).bit_length()


def _valid_prefix(draft: Draft, limit: int, vocab_size: int) -> list[int]:
    tokens = []
    for t in draft.tokens[:limit]:
        if not _is_token(t, vocab_size):
            break
        tokens.append(t)
    return tokens


def _is_token(t: object, vocab_size: int) -> bool:
    return isinstance(t, int) and 0 <= t < vocab_size


def _grammar_prefix(grammar: Any, tokens: list[int]) -> list[int]:
    kept = 0
    for t in tokens:
        if not grammar.accept_token(t):
            break
        kept += 1
        if grammar.is_terminated():
            kept -= 1  # the target samples the ending token itself
            grammar.rollback(1)
            break
    grammar.rollback(kept)
    return tokens[:kept]


def speculating(req: Req) -> bool:
    """Whether ``req`` may draft this step: decoding, with its last token on the host."""
    return _decodes_without_prompt_logprobs(req) and not req.num_pending


def may_speculate(req: Req) -> bool:
    """Whether ``req`` may draft once its last token is on the host."""
    return _decodes_without_prompt_logprobs(req)


def _decodes_without_prompt_logprobs(req: Req) -> bool:
    return req.state == ReqState.DECODE and req.logprob_start_len < 0
