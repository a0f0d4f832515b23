"""The Speculator's edges, without a model (core/speculative.py; the policy's main lines are in
test_speculative_policy.py): statistics, what the plugin is asked for, checked drafts of every
shape in one step, trees, retries at exactly break-even, inherited and device-loop pauses,
decode probes per batch size, and what a request may draft."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from radixserve.core import spec_tree
from radixserve.core.interfaces import Draft, SpeculativeAlgorithm
from radixserve.core.request import Req, ReqState, SamplingParams
from radixserve.core.spec_adaptive import AdaptiveDrafting
from radixserve.core.speculative import SpecStats, Speculator


class Scripted(SpeculativeAlgorithm):
    """Answers each propose with the drafts it was given; records every call."""

    drafts_trees = True

    def __init__(self, drafts: list[Draft] | None = None) -> None:
        self.drafts = drafts or []
        self.calls: list[tuple[Any, ...]] = []

    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        self.calls.append(("chains", list(max_drafts)))
        return self.drafts

    def propose_trees(
        self, reqs: Sequence[Any], max_depths: Sequence[int], max_nodes: Sequence[int]
    ) -> list[Draft]:
        self.calls.append(("trees", list(max_depths), list(max_nodes)))
        return self.drafts

    def verified(self, reqs: Sequence[Any], accepted: Sequence[int]) -> None:
        self.calls.append(("verified", [r.rid for r in reqs], list(accepted)))


def spec_of(algorithm: SpeculativeAlgorithm | None = None, **kw: Any) -> Speculator:
    return Speculator(algorithm or Scripted(), "scripted", 4, 32, vocab_size=100, **kw)


def req(rid: str = "r", decoding: bool = True) -> Req:
    r = Req(rid, [1, 2, 3], SamplingParams(temperature=0))
    if decoding:
        r.state = ReqState.DECODE
    return r


def pauses(spec: Speculator, r: Req, steps: int) -> list[bool]:
    return [spec.wants(r) for _ in range(steps)]


def test_statistics_count_every_verify_and_report_as_json() -> None:
    assert SpecStats().avg_accept_length == 0.0
    algorithm = Scripted()
    spec = spec_of(algorithm, pause_unprofitable=False)
    a, b = req("a"), req("b")
    spec.verified([a, b], [4, 3], [2, 1], batch_size=2)
    spec.verified([a], [4], [4], batch_size=1)
    assert spec.stats.to_json() == {
        "verify_steps": 2, "verified_requests": 3, "draft_tokens": 11, "accepted_tokens": 7,
        "avg_accept_length": round(10 / 3, 4), "trees": 0,
    }  # fmt: skip
    assert (a.spec_verify_ct, a.spec_draft_tokens, a.spec_accepted_tokens) == (2, 8, 6)
    assert (b.spec_verify_ct, b.spec_draft_tokens, b.spec_accepted_tokens) == (1, 3, 1)
    assert algorithm.calls == [("verified", ["a", "b"], [2, 1]), ("verified", ["a"], [4])]
    with pytest.raises(ValueError):  # one count per request
        spec.verified([a, b], [4], [1], batch_size=2)
    spec.close()
    assert spec.algorithm is None


def test_one_step_checks_drafts_of_every_shape_in_order(caplog: pytest.LogCaptureFixture) -> None:
    pending = torch.tensor([7, 8, 9])
    drafts = [
        Draft([3, 4], None, None, [-1, 0]),  # a tree
        Draft([1, 2, 3], torch.ones(3, 5), pending),  # on the device, cut to 2
        Draft([5, 6, 7], torch.ones(3, 5)),  # a chain, cut to 2
        Draft([4, 5], torch.ones(2, 5), torch.tensor([1, 2])),  # on the device, limit 0
        Draft([150, 6], torch.ones(2, 5)),  # outside the vocabulary at once: nothing left
        Draft([1, 2], None, None, [-1, 5]),  # a bad tree
    ]
    algorithm = Scripted(drafts)
    spec = spec_of(algorithm, tree_nodes=4)
    reqs = [req(str(i)) for i in range(6)]
    with caplog.at_level(logging.WARNING, logger="radixserve.core.speculative"):
        out = spec.propose(reqs, [2, 2, 2, 0, 2, 2], [4, 0, 0, 0, 0, 4])
    assert algorithm.calls == [("trees", [2, 2, 2, 0, 2, 2], [4, 0, 0, 0, 0, 4])]
    tree, device, chain, none, outside, bad = out
    assert (tree.tokens, tree.parents) == ([3, 4], [-1, 0])
    assert device.tokens == [0, 0] and torch.equal(device.pending, pending[:2])
    assert device.probs is not None and device.probs.shape == (2, 5)
    assert chain.tokens == [5, 6] and chain.probs is not None and chain.probs.shape == (2, 5)
    assert (none.tokens, none.probs, none.pending) == ([], None, None)
    assert (outside.tokens, outside.probs) == ([], None)
    assert (bad.tokens, bad.parents) == ([], None)
    assert spec.stats.trees == 1
    [record] = caplog.records
    assert record.getMessage().startswith("speculative plugin 'scripted' drafted a bad tree: ")
    assert record.getMessage() != "speculative plugin 'scripted' drafted a bad tree: None"
    # chains only: the plugin's propose, with the limits
    chains = Scripted([Draft([5, 6]), Draft([7])])
    spec_of(chains).propose(reqs[:2], [1, 3])
    spec_of(chains).propose(reqs[:2], [1, 3], [0, 0])
    assert chains.calls == [("chains", [1, 3])] * 2
    trees = Scripted([Draft([3], None, None, [-1]), Draft([3, 4], None, None, [-1, 0])])
    spec = spec_of(trees, tree_nodes=4)
    spec.propose(reqs[:2], [2, 2], [4, 4])
    assert spec.stats.trees == 2
    with pytest.raises(RuntimeError) as err:
        spec_of(Scripted([Draft([1])])).propose(reqs[:2], [1, 1])
    assert str(err.value) == "speculative plugin 'scripted' returned 1 drafts for 2 requests"
    with pytest.raises(ValueError):  # one limit per request
        spec_of(Scripted([Draft([1]), Draft([2])])).propose(reqs[:2], [1])


def test_trees_only_for_few_unconstrained_drafters() -> None:
    spec, r = spec_of(tree_nodes=6), req()
    assert spec.tree_nodes_for(r, spec_tree.TREE_BATCH) == 6
    assert spec.tree_nodes_for(r, spec_tree.TREE_BATCH + 1) == 0
    assert spec_of().tree_nodes_for(r, 1) == 0  # chains only
    r.grammar = object()
    assert spec.tree_nodes_for(r, 1) == 0


def test_a_retry_at_exactly_break_even_resumes_drafting() -> None:
    spec = spec_of()
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.020)  # break-even: 2 tokens a verify
    r = req()
    for _ in range(4):  # gains 1: 5 -> 3.8 -> 2.96 -> 2.37 -> 1.96 < 2
        spec.verified([r], [4], [0], batch_size=1)
    assert pauses(spec, r, 5) == [False] * 4 + [True]
    spec.verified([r], [4], [1], batch_size=1)  # the retry gains exactly 2: it pays
    assert pauses(spec, r, 2) == [True, True]


def test_without_a_decode_step_measured_a_gain_of_one_token_still_pays() -> None:
    spec, r = spec_of(), req()
    spec.observe_step(True, 1, 0.020)  # a verify measured, no decode: probes are due
    for _ in range(3):  # three probes, then judged on gains alone
        spec.verified([r], [4], [0], batch_size=1)
        assert pauses(spec, r, 4) == [False] * 3 + [True]
    for _ in range(6):
        spec.verified([r], [4], [0], batch_size=1)
        assert spec.wants(r)


def test_decode_probes_are_counted_per_batch_size() -> None:
    spec, a, b = spec_of(), req("a"), req("b")
    for _ in range(3):
        assert spec.probe_decode([a], 1)
        assert spec.probe_decode([b], 1)  # the same verify step: the same probe
        assert pauses(spec, a, 4) == pauses(spec, b, 4) == [False] * 3 + [True]
        spec.verified([a], [1], [1], batch_size=1, judge=False)
    assert not spec.probe_decode([a], 1)  # three for batch size 1 ...
    assert spec.probe_decode([a], 2)  # ... and their own for batch size 2
    spec.observe_step(False, 2, 0.01)
    assert not spec.probe_decode([a], 2)  # measured now
    fresh = spec_of()
    assert fresh.probe_decode([a], 2)
    fresh.verified([a], [1], [1], batch_size=2, judge=False)
    assert fresh.probe_decode([a], 1)  # another size's probe does not count


def test_a_new_request_inherits_half_a_device_loop_pause() -> None:
    spec = spec_of()
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.020)
    spec.pause([req("a")], 8)
    b = req("b")
    assert pauses(spec, b, 5) == [False] * 4 + [True]  # 8 // 2 steps
    spec.verified([b], [4], [3], batch_size=1)  # its retry, judged
    assert spec.wants(b)
    spec.paying()
    assert spec.wants(req("c"))


def test_a_device_loop_pause_keeps_a_longer_own_pause_and_starts_fresh_requests_full() -> None:
    spec = spec_of()
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.020)
    r = req()
    for _ in range(4):
        spec.verified([r], [4], [0], batch_size=1)  # paused 4 steps by its own verdict
    spec.pause([r], 2)
    assert pauses(spec, r, 5) == [False] * 4 + [True]
    # a request first paused by the device loop starts from the most a verify can gain (5):
    # gains of 1 pause it after its fourth verify, as a request never paused
    fresh = req("fresh")
    spec.pause([fresh], 1, probe=True)
    assert pauses(spec, fresh, 2) == [False, True]
    for _ in range(3):
        spec.verified([fresh], [4], [0], batch_size=1)
        assert spec.wants(fresh)
    spec.verified([fresh], [4], [0], batch_size=1)
    assert not spec.wants(fresh)


def test_what_a_request_may_draft_next_step() -> None:
    spec = spec_of()
    assert spec.may_draft(req())
    assert not spec.may_draft(req(decoding=False))
    scoring = req()
    scoring.logprob_start_len = 0
    assert not spec.may_draft(scoring)
    r = req()
    spec.pause([r], 1)
    assert not spec.may_draft(r) and not spec.may_draft(req("next"))  # inherits the verdict
    assert not spec.wants(r)  # the pause's one step
    assert spec.may_draft(r)
    adaptive = AdaptiveDrafting(4)
    with_adaptive = spec_of(adaptive=adaptive)
    assert with_adaptive.may_draft(req("x")) == adaptive.drafting("x")
    assert with_adaptive.draft_length(1000) == 4  # the cost model decides who drafts how far


def test_draft_lengths_beyond_the_full_batch_round_down() -> None:
    spec = spec_of()
    assert [spec.draft_length(n) for n in (9, 12, 31)] == [3, 2, 1]


def test_forgetting_a_request_drops_its_pause_and_its_simulated_remainder() -> None:
    spec = spec_of()
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.020)
    r = req()
    for _ in range(4):
        spec.verified([r], [4], [0], batch_size=1)
    assert not spec.wants(r)
    spec.forget("r")
    spec.paying()  # nothing inherited either
    assert spec.wants(r)
    sim = spec_of(simulate_accept_len=2.5, seed=0)
    draws = random.Random(0)
    first = draws.random() + 0.5
    assert sim.simulated(4, "a") == 1 + int(first)
    sim.forget("a")
    assert sim.simulated(4, "a") == 1 + int(draws.random() + 0.5)  # a fresh start


def test_only_judged_verifies_pause_a_request() -> None:
    for kw, judge in (({}, False), ({"pause_unprofitable": False}, True)):
        spec, r = spec_of(**kw), req()
        spec.observe_step(False, 1, 0.010)
        spec.observe_step(True, 1, 0.020)
        for _ in range(6):  # gains of 1 where 2 pay
            spec.verified([r], [4], [0], batch_size=1, judge=judge)
            assert spec.wants(r), kw


class Ending:
    """A grammar that accepts any token and ends after ``length`` of them; records rollbacks."""

    def __init__(self, length: int) -> None:
        self.length, self.taken, self.rollbacks = length, 0, []  # type: ignore[var-annotated]

    def accept_token(self, t: int) -> bool:
        self.taken += 1
        return True

    def is_terminated(self) -> bool:
        return self.taken >= self.length

    def rollback(self, n: int) -> None:
        self.rollbacks.append(n)
        self.taken -= n


def test_token_zero_counts_and_a_grammar_keeps_what_comes_before_its_end() -> None:
    spec = spec_of(Scripted([Draft([0, 5, 6, 7])]))
    r = req()
    assert spec.propose([r], [4])[0].tokens == [0, 5, 6, 7]
    r.grammar = grammar = Ending(3)
    assert spec.propose([r], [4])[0].tokens == [0, 5]  # the ending token: the target's
    assert grammar.rollbacks == [1, 2] and grammar.taken == 0


def test_who_may_speculate() -> None:
    from radixserve.core.speculative import may_speculate, speculating

    r = req()
    assert speculating(r) and may_speculate(r)
    r.num_pending = 1
    assert not speculating(r) and may_speculate(r)  # once its last token is on the host
    waiting = req(decoding=False)
    assert not speculating(waiting) and not may_speculate(waiting)


def test_a_one_step_device_loop_pause_passes_on_its_verdict_not_a_pause() -> None:
    spec = spec_of()
    spec.observe_step(False, 1, 0.010)
    spec.observe_step(True, 1, 0.020)
    spec.pause([req("a")], 1)
    b = req("b")
    assert spec.wants(b)  # half of one step: no pause, but the loop's verdict (no gain) ...
    spec.verified([b], [4], [1], batch_size=1)
    assert not spec.wants(b)  # ... so a first verify at break-even does not lift it


def test_trees_where_none_were_asked_for_and_empty_trees_are_empty_drafts() -> None:
    r = req()
    spec = spec_of(Scripted([Draft([3], None, None, [-1])]), tree_nodes=4)
    assert spec.propose([r], [2])[0].tokens == []  # a chain was asked for: no tree nodes
    spec = spec_of(Scripted([Draft([], None, None, [])]), tree_nodes=4)
    empty = spec.propose([r], [2], [4])[0]
    assert (empty.tokens, empty.parents) == ([], None) and spec.stats.trees == 0


def test_the_simulated_accept_length_from_the_environment_and_its_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from radixserve.core.config import ConfigError

    monkeypatch.setenv("RADIXSERVE_SIMULATE_ACC_LEN", "2.5")
    with caplog.at_level(logging.WARNING, logger="radixserve.core.speculative"):
        assert spec_of().simulate_accept_len == 2.5
    assert [r.getMessage() for r in caplog.records] == [
        "speculation simulates an accept length of 2.50: outputs are meaningless"
    ]
    assert spec_of(simulate_accept_len=3.0).simulate_accept_len == 3.0  # the setting wins
    monkeypatch.delenv("RADIXSERVE_SIMULATE_ACC_LEN")
    assert spec_of().simulate_accept_len is None

    class Chains(Scripted):
        drafts_trees = False

    with pytest.raises(ConfigError) as err:
        spec_of(Chains(), tree_nodes=4)
    assert str(err.value) == (
        "speculative plugin 'scripted' drafts chains only; speculative_eagle_topk > 1 "
        "(draft trees) needs eagle or eagle3"
    )


def test_step_times_go_to_the_adaptive_cost_model_and_keep_a_window() -> None:
    adaptive = AdaptiveDrafting(4)
    spec = spec_of(adaptive=adaptive)
    spec.observe_step(False, 2, 0.010, draft_rows=3)  # a decode step: its rows do not count
    assert adaptive.decode_time(2) == 0.010
    spec.observe_step(True, 2, 0.030, draft_rows=4)
    assert adaptive.row_cost(2) == pytest.approx((0.030 - 0.010) / 0.010 / 4)
    spec.observe_step(True, 2, 0.050)  # no draft rows given: a decode step to the model
    assert adaptive.decode_time(2) == pytest.approx(0.030)
    adaptive.observed("x", 4, 0)
    assert adaptive.accept_prob("x") != adaptive.accept_prob("unseen")
    spec.forget("x")
    assert adaptive.accept_prob("x") == adaptive.accept_prob("unseen")
    # the policy's own step times: the median of the last 15 of a kind and size
    plain = spec_of()
    for seconds in [1.0] * 15 + [3.0] * 15:
        plain.observe_step(False, 1, seconds)
    assert plain.step_time(False, 1) == 3.0
