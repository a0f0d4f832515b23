"""The Speculator's policy, without a model: how far requests draft by batch size, pausing the
drafting of requests whose drafts do not pay for their verify steps, checking drafts against
the vocabulary, the budget and the grammar, and the simulated accept count for benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from radixserve.core.interfaces import Draft, SpeculativeAlgorithm
from radixserve.core.request import Req, ReqState, SamplingParams
from radixserve.core.spec_verify import read_pending, verify_drafts
from radixserve.core.speculative import FULL_DRAFT_BATCH, Speculator


class Fixed(SpeculativeAlgorithm):
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.released: list[str] = []

    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        return [Draft(list(self.tokens)) for _ in reqs]


def _speculator(k: int = 4, **kw: Any) -> Speculator:
    return Speculator(Fixed([5, 6, 7, 8, 9]), "fixed", k, 32, vocab_size=100, **kw)


def _req(rid: str = "r") -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(temperature=0))


def test_draft_length_shrinks_with_batch_and_stops_past_the_limit() -> None:
    spec = _speculator(k=4)
    assert spec.draft_length(1) == spec.draft_length(FULL_DRAFT_BATCH) == 4
    assert spec.draft_length(16) == 4 * FULL_DRAFT_BATCH // 16 == 2
    assert spec.draft_length(32) == 1
    assert spec.draft_length(33) == 0


def _pauses(spec: Speculator, req: Req, steps: int) -> list[bool]:
    return [spec.wants(req) for _ in range(steps)]


def test_a_request_whose_drafts_do_not_pay_pauses_with_doubling_pauses() -> None:
    """The smoothed gain starts at the most a verify can gain, so one poor verify does not
    pause a request, a run of them does; the first verify after a pause decides alone whether
    drafting resumes, and a failed retry doubles the pause."""
    spec = _speculator()
    spec.observe_step(False, 1, 0.010)  # a decode step
    spec.observe_step(True, 1, 0.020)  # a verify step costs two decodes
    poor, rich = _req("poor"), _req("rich")
    for _ in range(3):  # gains 1 and 4 tokens: poor's smoothed gain 5 -> 3.8 -> 2.96 -> 2.37
        spec.verified([poor, rich], [4, 4], [0, 3], batch_size=1)
        assert spec.wants(poor) and spec.wants(rich)
    spec.verified([poor, rich], [4, 4], [0, 3], batch_size=1)  # poor: 1.96 < 2
    assert _pauses(spec, rich, 3) == [True] * 3
    assert _pauses(spec, poor, 5) == [False] * 4 + [True]
    spec.verified([poor], [4], [0], batch_size=1)  # the retry gains 1 < 2
    assert _pauses(spec, poor, 9) == [False] * 8 + [True]  # the pause doubled
    spec.verified([poor], [4], [4], batch_size=1)  # the next retry gains 5: drafting resumes
    assert _pauses(spec, poor, 3) == [True] * 3
    spec.verified([poor], [4], [0], batch_size=1)  # smoothed 2.9 -> 2.33: still pays
    assert spec.wants(poor)
    spec.forget("poor")
    assert spec.wants(poor)


def test_a_lucky_retry_resumes_drafting_but_the_episode_decides_the_next_pause() -> None:
    """A request just below break-even whose retry happens to pay resumes drafting; when it
    pauses again, the whole drafting episode decides how long: one that did not pay as a whole
    doubles the pause (each retry costs a catch-up), one that did starts over at the first."""
    spec = _speculator()
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.030)  # a verify costs three decodes
    req = _req()
    for _ in range(2):  # gains 1: smoothed 5 -> 3.8 -> 2.96 < 3: a pause of 4
        spec.verified([req], [4], [0], batch_size=1)
    assert _pauses(spec, req, 5) == [False] * 4 + [True]
    spec.verified([req], [4], [4], batch_size=1)  # the retry gains 5: 3 -> 3.6, resumes
    assert spec.wants(req)
    spec.verified([req], [4], [0], batch_size=1)  # 3.6 -> 2.82: 6 tokens in 2 verifies
    assert _pauses(spec, req, 9) == [False] * 8 + [True]  # did not pay: paused 8, not 4
    for gained in (5, 5, 5, 1):  # 3.6, 4.02, 4.31, 3.32: drafting goes on
        spec.verified([req], [4], [gained - 1], batch_size=1)
        assert spec.wants(req)
    spec.verified([req], [4], [0], batch_size=1)  # 2.62 < 3: 17 tokens in 5 verifies paid
    assert _pauses(spec, req, 5) == [False] * 4 + [True]  # so the pause starts over at 4
    spec.verified([req], [4], [4], batch_size=1)  # resumes; then 5 + 1 in 2 verifies
    spec.verified([req], [4], [0], batch_size=1)
    assert _pauses(spec, req, 9) == [False] * 8 + [True]  # did not pay: doubled from 4


def test_scattered_gains_just_below_break_even_back_off_to_the_longest_pause() -> None:
    """Open chat on a CPU: a request's gains scatter around break-even (here 2 tokens), so a
    retry often pays and the next verify still does before a poor one pauses it. Each episode
    as a whole did not pay, so the pauses keep doubling up to the longest, where a verify that
    paid used to restart them at the first."""
    spec = _speculator()
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.020)  # a verify costs two decodes
    req = _req()
    for _ in range(4):  # gains 1: 5 -> 3.8 -> 2.96 -> 2.37 -> 1.96: a pause of 4
        spec.verified([req], [4], [0], batch_size=1)
    pauses = []
    for _ in range(6):
        pauses.append(_pauses(spec, req, 100).index(True))
        for gained in (3, 2, 1):  # 2.3 resumes, 2.21 still pays, 1.85 pauses: 6 in 3 verifies
            spec.verified([req], [4], [gained - 1], batch_size=1)
    assert pauses == [4, 8, 16, 32, 64, 64]


def test_verify_steps_whose_drafter_catches_up_are_not_what_drafting_costs() -> None:
    """A verify step in which a request drafted after not drafting the step before (its first
    draft, or its first after a pause) paid for its drafter's catch-up: it is not sampled."""
    spec = _speculator()
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.090, catching_up=True)
    assert spec.step_time(True, 1) is None
    spec.observe_step(True, 1, 0.015)
    assert spec.step_time(True, 1) == 0.015
    spec.observe_step(False, 1, 0.012, catching_up=True)  # a decode step catches nothing up
    assert spec.step_time(False, 1) == 0.011


def test_a_batch_size_with_no_decode_step_measured_pauses_to_measure_one() -> None:
    """Drafts that always gain 2 tokens never pause by the gain rule alone: the requests of a
    verify step at a batch size with no decode step measured pause together for three steps
    (decode-only steps, the later of which overlap as plain decoding does, and measure it), at
    most three times per size; once measured, a verify step costing three decode steps makes
    gains of 2 pause."""
    spec = _speculator()
    a, b = _req("a"), _req("b")
    spec.verified([a, b], [4, 4], [1, 1], batch_size=2)
    probe = [False, False, False, True]
    assert _pauses(spec, a, 4) == _pauses(spec, b, 4) == probe  # paused together
    for probed in (True, True, False):  # probes two and three, then no more
        spec.verified([a, b], [4, 4], [1, 1], batch_size=2)
        assert _pauses(spec, a, 4) == (probe if probed else [True] * 4)
    spec.observe_step(False, 1, 0.010)  # batch 1: a decode step measured ...
    spec.observe_step(True, 1, 0.030)  # ... and a verify costing three
    spec.verified([a], [4], [1], batch_size=1)
    assert _pauses(spec, a, 5) == [False] * 4 + [True]


def test_pausing_can_be_turned_off() -> None:
    spec = _speculator(pause_unprofitable=False)
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.020)
    req = _req()
    for _ in range(3):
        spec.verified([req], [4], [0], batch_size=1)
    assert _pauses(spec, req, 10) == [True] * 10
    assert req.spec_verify_ct == 3 and req.spec_accepted_tokens == 0


def test_drafts_are_cut_at_the_limit_and_the_vocabulary() -> None:
    spec = Speculator(Fixed([5, 6, 700, 8]), "fixed", 4, 32, vocab_size=100)
    drafts = spec.propose([_req("a"), _req("b")], [4, 1])
    assert [d.tokens for d in drafts] == [[5, 6], [5]]


class _Grammar:
    """Accepts tokens below 50; accepting 7 ends the grammar."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, token: int) -> bool:
        if token >= 50:
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == 7

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n :]


@pytest.mark.parametrize(
    ("tokens", "kept"), [([5, 6, 60, 8], [5, 6]), ([5, 7, 8], [5]), ([9, 9], [9, 9])]
)
def test_constrained_drafts_stop_where_the_grammar_would(
    tokens: list[int], kept: list[int]
) -> None:
    spec = Speculator(Fixed(tokens), "fixed", 4, 32, vocab_size=100)
    req = _req()
    req.grammar = _Grammar()
    assert spec.propose([req], [4])[0].tokens == kept
    assert req.grammar.accepted == []  # the matcher is left as it was


def test_simulated_accept_counts_have_the_chosen_mean() -> None:
    spec = _speculator(simulate_accept_len=2.5)
    # Requests drawn in turn, as in a batch: each keeps the mean over every run of its own
    # draws, not only the batch on average (a shared rounding would favour every other one).
    draws: dict[str, list[int]] = {"a": [], "b": [], "c": [], "d": []}
    for _ in range(1000):
        for rid, own in draws.items():
            own.append(spec.simulated(4, rid))
    for own in draws.values():
        assert set(own) == {1, 2}
        for n in (7, 40, 91, 1000):
            assert abs(sum(own[:n]) - 1.5 * n) < 1, n
    spec = _speculator(simulate_accept_len=3.25)
    assert abs(sum(spec.simulated(4, "a") for _ in range(100)) - 225) < 1
    assert max(spec.simulated(1) for _ in range(50)) == 1  # never past the draft


class OnDevice(SpeculativeAlgorithm):
    """Drafts left where a draft model computed them (``Draft.pending``)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        return [Draft([0] * len(self.tokens), pending=torch.tensor(self.tokens)) for _ in reqs]


def test_pending_drafts_are_cut_to_the_limit_and_read_with_the_verify_result() -> None:
    spec = Speculator(OnDevice([5, 6, 60, 8]), "dev", 4, 32, vocab_size=100)
    plain, other, constrained = _req("plain"), _req("other"), _req("constrained")
    constrained.grammar = _Grammar()
    (draft,) = spec.propose([plain], [3])
    assert draft.pending is not None and draft.tokens == [0, 0, 0]  # only its length known
    # With a constrained request in the batch, every draft is read at once, for its grammar.
    read = spec.propose([other, constrained], [4, 4])
    assert [d.pending for d in read] == [None, None]
    assert [d.tokens for d in read] == [[5, 6, 60, 8], [5, 6]]
    # Target rows: row 0 chooses 5 (the first draft token, accepted), row 1 chooses 9 (not 6).
    logits = torch.full((4 + 1, 100), -1.0)
    for row, token in enumerate([5, 9, 1, 2, 7]):
        logits[row, token] = 1.0
    emitted = verify_drafts(logits, [plain, other], [draft, None], [], None, spec)
    assert draft.pending is None and draft.tokens == [5, 6, 60]
    assert [[t for t, _, _ in e] for e in emitted] == [[5, 9], [7]]
    assert read_pending([None, Draft([1])], torch.tensor([4, 2])) == [4, 2]


@pytest.mark.parametrize("overlap", [True, False])
def test_plain_decoding_is_measured_by_steps_that_overlapped_under_the_overlap_schedule(
    overlap: bool,
) -> None:
    """The policy's decode reference is plain decoding's step cycle. Under the overlap schedule
    a decode-only step launched alone (the first after a verify step) also carries the host's
    work, so it does not count; without overlap every step runs alone and all count. Verify
    steps always count, steps with a prefill never do."""
    from types import SimpleNamespace

    from radixserve.core.spec_strategy import is_reference_step

    def step(decodes: int, drafts: int, prefills: int, overlapped: bool) -> tuple[Any, bool]:
        plan = SimpleNamespace(
            reqs=[object()] * (decodes + drafts + prefills),
            num_decode=decodes,
            extra={i: Draft([1]) for i in range(drafts)},
        )
        return plan, overlapped

    counts = lambda s: is_reference_step(*s, overlap)  # noqa: E731
    assert counts(step(4, 0, 0, overlapped=True))
    assert counts(step(4, 0, 0, overlapped=False)) is not overlap
    assert counts(step(2, 2, 0, overlapped=False))
    assert not counts(step(3, 0, 1, overlapped=True))


def test_a_new_request_starts_paused_while_the_last_judged_one_did_not_pay() -> None:
    """Requests of one workload gain alike: after a request's drafts did not pay, the next
    request starts paused (half the last pause, at most 8 steps: unrelated requests follow
    each other too), not from a fresh retry, and backs off from the last pause if its first
    verify does not pay either; after one paid, a new request drafts at once."""
    spec = _speculator()
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.030)  # a verify costs three decodes
    first = _req("first")
    for _ in range(4):  # gains 1 token a verify: 3.8 pays, then pauses of 4, 8 and 16
        spec.verified([first], [4], [0], batch_size=1)
    second, third = _req("second"), _req("third")
    for req in (second, third):
        req.state = ReqState.DECODE
    assert not spec.may_draft(second)
    assert _pauses(spec, second, 9) == [False] * 8 + [True]  # half of the next pause, 32: 8
    spec.verified([second], [4], [0], batch_size=1)  # its first verify gains 1 as well
    assert _pauses(spec, second, 33) == [False] * 32 + [True]  # the last one's next pause
    rich = _req("rich")
    spec.verified([rich], [4], [4], batch_size=1)  # gains 5: pays
    assert spec.may_draft(third) and spec.wants(third)


def test_a_one_off_slow_verify_step_does_not_make_drafts_look_unprofitable() -> None:
    """Step times are a recent median: one verify step that took 100 decode steps (a kernel
    compiled for its shape) leaves drafts gaining 3 tokens at a 2-decode verify paying."""
    spec = _speculator()
    spec.observe_step(False, 1, 0.010)
    for seconds in (0.020, 1.0, 0.020):
        spec.observe_step(True, 1, seconds)
    req = _req()
    spec.verified([req], [4], [2], batch_size=1)
    assert spec.wants(req)


def test_step_times_are_shared_by_batch_sizes_of_one_power_of_two() -> None:
    """A decode step measured at 7 requests and a verify at 6 judge a verify at 5: requests
    finishing one by one leave every size of the class measured."""
    spec = _speculator()
    spec.observe_step(False, 7, 0.010)
    spec.observe_step(True, 6, 0.030)
    reqs = [_req(f"r{i}") for i in range(5)]
    for _ in range(4):  # gains 2 against 3 needed: smoothed 5 -> 4.1 -> 3.47 -> 3.03 -> 2.72
        spec.verified(reqs, [4] * 5, [1] * 5, batch_size=5)
    assert not spec.wants(reqs[0])
    spec.observe_step(False, 9, 0.001)  # another class: no effect on size 5's
    rich = _req("rich")
    spec.verified([rich], [4], [3], batch_size=5)  # gains 4: pays
    assert spec.wants(rich)
