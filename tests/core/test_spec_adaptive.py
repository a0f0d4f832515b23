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


def _costed(policy: AdaptiveDrafting, batch: int, row_cost: float) -> None:
    """A decode step of 1 s and a one-row verify step of ``1 + row_cost`` s at ``batch``."""
    for _ in range(3):
        policy.observe_step(batch, 0, 1.0)
        policy.observe_step(batch, 1, 1.0 + row_cost)


def test_the_greedy_takes_rows_while_their_gain_beats_their_share_of_the_step() -> None:
    """A new request (p = PRIOR_P = 0.6) alone at batch 1: row j is taken while
    0.6^j * (1 + c * rows so far) > c * (1 + gains so far)."""
    expected = {0.05: 4, 0.1: 3, 0.2: 2, 0.4: 1, 0.8: 0}
    for row_cost, length in expected.items():
        policy = AdaptiveDrafting(MAX)
        _costed(policy, 1, row_cost)
        assert policy.plan(["new"], 1) == {"new": length}, row_cost
    one = AdaptiveDrafting(1)  # a one-token draft is a draft
    _costed(one, 1, 0.05)
    assert one.plan(["a"], 1) == {"a": 1} and one.drafting("a")


def test_a_request_that_never_gains_probes_at_doubling_intervals_up_to_the_most() -> None:
    policy = AdaptiveDrafting(MAX)
    _costed(policy, 1, row_cost=5.0)  # no draft ever pays
    lengths = _run(policy, 200, lambda step, k: 0)
    probes = [i for i, k in enumerate(lengths) if k]
    # waits of 4, 8, 16, 32 then 64 (MAX_PROBE) steps without a draft, each ended by a probe
    assert probes == [3, 11, 27, 59, 123, 187], probes
    assert {lengths[i] for i in probes} == {adaptive_mod.PROBE_DRAFT}
    assert policy.steps_planned == 200


def test_drafting_tells_who_needs_its_last_token_on_the_host() -> None:
    policy = AdaptiveDrafting(MAX)
    _costed(policy, 1, row_cost=0.1)
    assert policy.drafting("never-planned")
    assert policy.plan(["a"], 1)["a"] > 0 and policy.drafting("a")
    for _ in range(8):
        policy.observed("a", 4, 0)  # its drafts stop paying
    waits = []
    for _ in range(3):
        assert policy.plan(["a"], 1)["a"] == 0
        waits.append(policy.drafting("a"))
    # idle 1, 2, 3 after it stopped: the probe comes at the 4th plan, announced after the 3rd
    assert waits == [False, False, True], waits
    assert policy.plan(["a"], 1)["a"] == adaptive_mod.PROBE_DRAFT and policy.drafting("a")
    assert policy.plan(["a"], 1)["a"] == 0 and not policy.drafting("a")


def test_decode_probes_stop_after_the_most_when_no_decode_step_is_ever_measured() -> None:
    """Steps that draft nothing may go unmeasured (overlapped): the policy probes at most
    MAX_DECODE_PROBES times, each after DECODE_PROBE_AFTER verify steps."""
    policy = AdaptiveDrafting(MAX)
    idle = []
    for step in range(40):
        k = policy.plan(["a"], 3)["a"]
        if k:
            policy.observe_step(3, k, 0.02)
            policy.observed("a", k, k)
        else:
            idle.append(step)
    assert idle == [4, 5, 6, 11, 12, 13, 18, 19, 20], idle
    assert policy.decode_time(3) is None and policy.row_cost(3) == adaptive_mod.PRIOR_ROW_COST


def test_step_times_keep_a_window_and_one_row_steps_are_verify_steps() -> None:
    policy = AdaptiveDrafting(MAX)
    for seconds in [1.0] * 10 + [2.0] * 10:  # the median of the last WINDOW (15) steps
        policy.observe_step(1, 0, seconds)
    assert policy.decode_time(1) == 2.0
    policy.observe_step(1, 1, 3.0)  # one draft row: a verify step, costing one decode step
    assert policy.decode_time(1) == 2.0 and policy.row_cost(1) == 0.5
    for cost in [0.3] * 10 + [0.1] * 10:  # the last 15: five at 0.3, ten at 0.1
        policy.observe_step(1, 2, 2.0 * (1 + 2 * cost))
    assert abs(policy.row_cost(1) - 0.1) < 1e-9
    free = AdaptiveDrafting(MAX)
    free.observe_step(2, 0, 0.0)  # a decode step too short to time: no cost from it
    free.observe_step(2, 4, 0.01)
    assert free.row_cost(2) == adaptive_mod.PRIOR_ROW_COST


def test_acceptance_estimate_counts_accepts_and_one_failure_per_rejection() -> None:
    policy = AdaptiveDrafting(MAX)
    policy.plan(["a"], 1)
    assert abs(policy.accept_prob("a") - adaptive_mod.PRIOR_P) < 1e-9
    # prior (1.2, 0.8) decayed by half, plus 2 accepted and one rejection: 2.6 / 4.0
    policy.observed("a", 4, 2)
    assert abs(policy.accept_prob("a") - 0.65) < 1e-9
    policy.observed("a", 0, 0)  # nothing drafted: nothing learnt, nothing decayed
    assert abs(policy.accept_prob("a") - 0.65) < 1e-9
    policy.observed("a", 4, 4)  # (1.3 + 4) / (1.3 + 4 + 0.7)
    assert abs(policy.accept_prob("a") - 5.3 / 6.0) < 1e-9


def test_the_recent_requests_mean_covers_the_last_sixteen() -> None:
    policy = AdaptiveDrafting(MAX)
    policy.forget("unknown")  # never seen: nothing to forget
    assert policy.accept_prob("new") == adaptive_mod.PRIOR_P
    for _ in range(8):  # 17 requests from the prior; the first accepts everything
        for i in range(17):
            policy.observed(f"r{i}", 4, 4 if i == 0 else 0)
    for i in range(17):  # ... and drops out of the window when the 17th ends
        policy.forget(f"r{i}")
    low = AdaptiveDrafting(MAX)
    for _ in range(8):
        low.observed("r", 4, 0)
    assert abs(policy.accept_prob("new") - low.accept_prob("r")) < 1e-9


def test_the_device_loop_pays_only_where_every_request_gains_more_than_its_rows_cost() -> None:
    policy = AdaptiveDrafting(MAX)
    _costed(policy, 1, row_cost=0.4)
    # a new request (p = 0.6): 1 draft gains 0.6 > 0.4; 4 gain 1.31 < 1.6
    assert policy.pays_at(["new"], 1, 1) and not policy.pays_at(["new"], 1, 4)


def test_a_uniform_step_drafts_where_the_whole_step_gains() -> None:
    """One request that accepts nearly everything (p = 0.95, 4 drafts gain ~3.52 tokens)."""
    for batch, row_cost, drafts in ((1, 0.5, MAX), (1, 0.9, 0), (8, 0.02, MAX), (8, 0.15, 0)):
        policy = AdaptiveDrafting(MAX)
        _costed(policy, batch, row_cost)
        for _ in range(8):
            policy.observed("a", 4, 4)
        assert policy.plan(["a"], batch, uniform=True) == {"a": drafts}, (batch, row_cost)


def test_tree_sizes_follow_the_budget_and_the_acceptance() -> None:
    # a new request (p = 0.6) with 16 nodes for 4 levels: width round(0.4 * 2 * 4) = 3
    assert AdaptiveDrafting(4, tree_nodes=16).tree_nodes_for("new", 4) == 12
    assert AdaptiveDrafting(4, tree_nodes=16).tree_nodes_for("new", 1) == 3
    assert AdaptiveDrafting(4, tree_nodes=16).tree_nodes_for("new", 0) == 0
    unsure = {}
    for max_draft, nodes in ((4, 4), (4, 10), (1, 4)):
        policy = AdaptiveDrafting(max_draft, tree_nodes=nodes)
        for _ in range(8):
            policy.observed("u", 4, 0)
        unsure[(max_draft, nodes)] = policy.tree_nodes_for("u", max_draft)
    # 4 nodes over 4 levels: a chain; 10 over 4: width 2 (8 nodes); 4 over 1 level: width 4
    assert unsure == {(4, 4): 0, (4, 10): 8, (1, 4): 4}
