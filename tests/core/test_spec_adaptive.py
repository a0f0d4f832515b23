"""Adaptive drafting's policy (core/spec_adaptive.py) on synthetic acceptance sequences and
step times: no engine, no clock."""

from __future__ import annotations

from collections.abc import Callable

import radixserve.core.spec_adaptive as adaptive_mod
from radixserve.core.spec_adaptive import AdaptiveDrafting, bucket, expected_gain

MAX = 4


def _measured(policy: AdaptiveDrafting, batch: int, row_cost: float) -> None:
    """Step times as if a decode step took 10 ms and each draft row ``row_cost`` of it."""
    for _ in range(3):
        policy.observe_step(batch, 0, 0.010)
        policy.observe_step(batch, 4 * batch, 0.010 * (1 + row_cost * 4 * batch))


def _run(
    policy: AdaptiveDrafting, steps: int, accepts: Callable[[int, int], int], rid: str = "a"
) -> list[int]:
    """The lengths planned for one request over ``steps`` steps; ``accepts(step, k)``: how many
    of its k drafts the target accepts."""
    lengths = []
    for step in range(steps):
        k = policy.plan([rid], 1)[rid]
        lengths.append(k)
        if k:
            policy.observed(rid, k, accepts(step, k))
    return lengths


def test_a_request_that_stops_gaining_stops_drafting_within_a_few_steps_then_probes() -> None:
    policy = AdaptiveDrafting(MAX)
    _measured(policy, 1, row_cost=0.15)
    # accepts everything for 10 steps, then nothing
    lengths = _run(policy, 80, lambda step, k: k if step < 10 else 0)
    assert lengths[5:10] == [MAX] * 5  # full accepts: drafts the maximum
    stopped = next(i for i in range(10, 80) if lengths[i] == 0)
    assert stopped - 10 <= 5, lengths[:20]
    # it probes again later with a short draft, less and less often while probes fail
    probes = [i for i in range(stopped, 80) if lengths[i] > 0]
    assert len(probes) >= 3 and all(lengths[i] <= adaptive_mod.PROBE_DRAFT for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], gaps


def test_a_probe_that_gains_resumes_drafting_deeper() -> None:
    policy = AdaptiveDrafting(MAX)
    _measured(policy, 1, row_cost=0.15)
    # nothing accepted for 20 steps, then everything
    lengths = _run(policy, 60, lambda step, k: 0 if step < 20 else k)
    assert 0 in lengths[5:20]
    assert lengths[-5:] == [MAX] * 5, lengths


def test_lengths_follow_acceptance() -> None:
    """A request accepting about half its drafts drafts shorter than one accepting most."""
    lengths = {}
    for name, rate in (("low", 0.5), ("high", 0.9)):
        policy = AdaptiveDrafting(MAX)
        _measured(policy, 1, row_cost=0.15)
        # accepts floor(rate * k) of each draft: the geometric estimate sees p near rate
        out = _run(policy, 40, lambda step, k, rate=rate: int(rate * k + 0.5) if k > 1 else 1)
        lengths[name] = out[-10:]
    assert max(lengths["low"]) < MAX
    assert sum(lengths["high"]) > sum(lengths["low"])


def test_greedy_gives_the_rows_to_the_request_that_gains_more() -> None:
    policy = AdaptiveDrafting(MAX)
    _measured(policy, 2, row_cost=0.1)
    for _ in range(10):
        policy.observed("good", 4, 4)
        policy.observed("poor", 4, 0)
    plan = policy.plan(["good", "poor"], 2)
    assert plan["good"] == MAX and plan["poor"] == 0


def test_the_batch_size_cut_off_follows_from_the_measured_row_cost() -> None:
    """Rows nearly free at batch 1 and costly at batch 32: the same requests draft the most
    at one and nothing at the other."""
    policy = AdaptiveDrafting(MAX)
    _measured(policy, 1, row_cost=0.01)
    _measured(policy, 32, row_cost=0.2)
    rids = [f"r{i}" for i in range(32)]
    for rid in rids:
        for _ in range(5):
            policy.observed(rid, 4, 2)  # p ~ 2/3
    assert policy.plan(rids[:1], 1) == {"r0": MAX}
    assert set(policy.plan(rids, 32).values()) == {0}
    assert policy.row_cost(32) > policy.row_cost(1)


def test_a_decode_step_is_measured_when_every_request_keeps_drafting() -> None:
    policy = AdaptiveDrafting(MAX)
    plans = []
    for _ in range(12):
        k = policy.plan(["a"], 3)["a"]
        plans.append(k)
        policy.observe_step(3, k, 0.01 * (1 + 0.05 * k))
        if k:
            policy.observed("a", k, k)
    first = plans.index(0)
    assert first == adaptive_mod.DECODE_PROBE_AFTER
    assert plans[first : first + adaptive_mod.PROBE_STEPS] == [0] * adaptive_mod.PROBE_STEPS
    assert policy.decode_time(4) == 0.01 and all(plans[first + adaptive_mod.PROBE_STEPS :])
    assert policy.row_cost(3) > 0.0


def test_uniform_steps_give_every_request_one_length() -> None:
    policy = AdaptiveDrafting(MAX)
    _measured(policy, 4, row_cost=0.02)
    for _ in range(5):
        policy.observed("a", 4, 4)
        policy.observed("b", 4, 1)
    plan = policy.plan(["a", "b", "c"], 4, uniform=True)
    assert plan == {"a": MAX, "b": MAX, "c": MAX}  # the verify graph's one length
    poor = AdaptiveDrafting(MAX)
    _measured(poor, 4, row_cost=0.5)
    for _ in range(5):
        poor.observed("a", 4, 1)
    assert poor.plan(["a", "b"], 4, uniform=True) == {"a": 0, "b": 0}


def test_new_requests_start_from_the_recent_requests_acceptance() -> None:
    policy = AdaptiveDrafting(MAX)
    assert policy.accept_prob("new") == adaptive_mod.PRIOR_P
    for i in range(4):
        for _ in range(6):
            policy.observed(f"old{i}", 4, 0)
        policy.forget(f"old{i}")
    assert policy.accept_prob("new") < 0.1


def test_tree_width_grows_where_the_next_token_is_uncertain() -> None:
    policy = AdaptiveDrafting(4, tree_nodes=16)
    for _ in range(8):
        policy.observed("sure", 4, 4)
        policy.observed("unsure", 4, 0)
    assert policy.tree_nodes_for("sure", 4) == 0  # a chain
    assert 4 < policy.tree_nodes_for("unsure", 4) <= 16
    assert AdaptiveDrafting(4).tree_nodes_for("unsure", 4) == 0  # trees off


def test_the_device_loop_test_and_the_helpers() -> None:
    policy = AdaptiveDrafting(MAX)
    _measured(policy, 2, row_cost=0.3)
    for _ in range(6):
        policy.observed("a", 4, 4)
        policy.observed("b", 4, 0)
    assert policy.pays_at(["a"], 2, 4) and not policy.pays_at(["a", "b"], 2, 4)
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert expected_gain(0.5, 2) == 0.75 and expected_gain(0.9, 0) == 0
