"""core/priority.py's PriorityPolicy alone and on a Scheduler driven by hand, without a model:
ranks with aging, the admission order, the retraction victim, the per-priority counts, and
preemption for a waiting request of a higher rank (milliseconds a test; the engine-level
tests/core/test_priority.py checks the same end to end on the tiny Llama)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hand_scheduler import hand_scheduler

from radixserve.core.priority import PriorityPolicy, PriorityStats
from radixserve.core.request import Req, ReqState, SamplingParams
from radixserve.core.scheduler import Scheduler
from radixserve.core.step_plan import RetractionNeeded
from radixserve.core.tokenizer import Tokenizer

EOS, TOKEN = 0, 7


def make(tokenizer: Tokenizer, *, pool: int = 256, running: int = 2, **config: Any) -> Scheduler:
    config.setdefault("enable_priority_scheduling", True)
    return hand_scheduler(tokenizer, EOS, pool=pool, context=64, running=running, **config)


def req(rid: str, priority: int = 0, n: int = 4, start: int = 10, arrival: float = 0.0) -> Req:
    r = Req(rid, list(range(start, start + n)), SamplingParams(max_new_tokens=20, ignore_eos=True))
    r.priority = priority
    r.arrival_time = arrival
    return r


def step(sched: Scheduler) -> None:
    batch = sched.schedule()
    assert batch is not None
    sched.process_output(batch, {i: (TOKEN, None, None) for i in sched.needs_sampling(batch)})


def test_rank_is_the_priority_in_its_direction_plus_one_level_per_aging_steps() -> None:
    policy = PriorityPolicy(True, aging_steps=10)
    r = req("r", priority=3)
    assert policy.rank(r) == 3  # not arrived yet: no aging
    policy.step = 5
    policy.arrived(r)
    assert r.arrival_step == 5
    policy.step = 14
    assert policy.rank(r) == 3  # 9 steps waited
    policy.step = 15
    assert policy.rank(r) == 4
    policy.step = 36
    assert policy.rank(r) == 6
    low_first = PriorityPolicy(True, low_values_first=True, aging_steps=10)
    low_first.step = 36
    assert low_first.rank(r) == -3 + 3
    every_step = PriorityPolicy(True, aging_steps=0)  # at least one step a level
    every_step.step = 9
    assert every_step.rank(r) == 3 + 4
    queued = req("queued", priority=2)
    assert every_step.rank(queued) == 2  # not arrived: nothing waited
    every_step.step = 0
    every_step.arrived(queued)  # arrived at step 0
    every_step.step = 3
    assert every_step.rank(queued) == 2 + 3


def test_the_defaults_are_off_and_100_steps_a_level() -> None:
    policy = PriorityPolicy()
    ordered = [req("a", 1), req("b", 3)]
    assert policy.order(ordered) is ordered
    assert policy.victim(ordered).rid == "a"  # the newest: arrival times are equal
    on = PriorityPolicy(True)
    r = req("r", priority=0)
    on.arrived(r)
    on.step = 99
    assert on.rank(r) == 0
    on.step = 100
    assert on.rank(r) == 1


def test_a_request_keeps_its_first_arrival_step() -> None:
    policy = PriorityPolicy(True)
    r = req("r")
    policy.step = 7
    policy.arrived(r)
    policy.step = 12
    policy.arrived(r)  # queued again after a retraction
    assert r.arrival_step == 7
    first = req("first")
    policy.step = 0
    policy.arrived(first)
    assert first.arrival_step == 0
    policy.step = 3
    policy.arrived(first)
    assert first.arrival_step == 0


def test_admissions_are_counted_once_per_priority_with_their_queue_time() -> None:
    policy = PriorityPolicy(True)
    a, b, c = req("a", 2), req("b", 2), req("c", 5)
    a.arrival_time = time.perf_counter() - 30.0
    b.arrival_time = time.perf_counter() - 10.0
    for r in (a, b, c):
        policy.admitted(r)
    c.num_retractions = 1
    policy.admitted(c)  # admitted again after a retraction: not counted again
    stats = policy.by_priority
    assert stats[2].admitted == 2 and stats[5].admitted == 1
    assert 40.0 <= stats[2].queue_seconds < 40.0 + 3600
    assert stats[2].preempted == 0
    off = PriorityPolicy(False)
    off.admitted(req("d", 1))
    assert off.by_priority == {}


def test_stats_as_json_by_priority_value() -> None:
    policy = PriorityPolicy(True)
    policy.by_priority[10] = PriorityStats(admitted=3)
    policy.by_priority[-1] = PriorityStats(preempted=2)
    policy.by_priority[2] = PriorityStats(queue_seconds=1.5)
    assert policy.to_json() == {
        "-1": {"admitted": 0, "queue_seconds": 0.0, "preempted": 2},
        "2": {"admitted": 0, "queue_seconds": 1.5, "preempted": 0},
        "10": {"admitted": 3, "queue_seconds": 0.0, "preempted": 0},
    }
    assert list(policy.to_json()) == ["-1", "2", "10"]
    assert PriorityStats().to_json() == {"admitted": 0, "queue_seconds": 0.0, "preempted": 0}


def test_the_waiting_queue_in_rank_order_ties_in_queue_order() -> None:
    ordered = [req("a", 1), req("b", 3), req("c", 1), req("d", 3)]
    assert [r.rid for r in PriorityPolicy(True).order(ordered)] == ["b", "d", "a", "c"]
    low_first = PriorityPolicy(True, low_values_first=True)
    assert [r.rid for r in low_first.order(ordered)] == ["a", "c", "b", "d"]
    off = PriorityPolicy(False)
    assert off.order(ordered) is ordered
    one = ordered[:1]
    assert PriorityPolicy(True).order(one) is one  # nothing to sort


def test_the_victim_is_the_newest_of_the_lowest_rank() -> None:
    running = [req("old-low", 1, arrival=1.0), req("new-low", 1, arrival=2.0),
               req("newest-high", 5, arrival=3.0), req("old-lowest", 0, arrival=0.5)]  # fmt: skip
    assert PriorityPolicy(True).victim(running).rid == "old-lowest"
    assert PriorityPolicy(True).victim(running[:3]).rid == "new-low"
    assert PriorityPolicy(True, low_values_first=True).victim(running).rid == "newest-high"
    assert PriorityPolicy(False).victim(running).rid == "newest-high"  # the newest


def preempt(sched: Scheduler, allow_retract: bool = True) -> list[Req]:
    """The policy's preemption as ``Scheduler.schedule`` calls it first, with no step's
    chunks counted yet."""
    sched._scheduled = {}
    return sched.priority.preempt(sched, allow_retract)


def running_lows(tokenizer: Tokenizer, **kw: Any) -> tuple[Scheduler, list[Req]]:
    """Two low-priority requests decoding; the running limit (2) is reached."""
    sched = make(tokenizer, **kw)
    lows = [req("low-old", 1, arrival=1.0), req("low-new", 1, start=30, arrival=2.0)]
    for r in lows:
        sched.add_request(r)
    step(sched)
    assert sched.running == lows and all(r.state == ReqState.DECODE for r in lows)
    return sched, lows


def test_a_higher_rank_retracts_the_newest_lower_one_until_it_fits(tokenizer: Tokenizer) -> None:
    sched, lows = running_lows(tokenizer)
    top = req("top", 5, start=50, arrival=3.0)
    sched.add_request(top)
    assert not sched.would_fit(top)  # the running limit
    assert preempt(sched) == [lows[1]]  # one retraction makes room
    assert sched.running == [lows[0]]
    assert lows[1].state == ReqState.WAITING and lows[1].num_retractions == 1
    assert sched.stats.preemptions == 1
    assert sched.priority.by_priority[1].preempted == 1
    step(sched)  # admitted in this very step
    assert top.state == ReqState.DECODE and lows[1].state == ReqState.WAITING


def test_several_are_retracted_lowest_rank_first(tokenizer: Tokenizer) -> None:
    """A pool too small for the top request beside both running ones: both go, the lower
    rank first."""
    sched = make(tokenizer, pool=40, running=3, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    a = req("a", 2, n=8, arrival=3.0)
    b = req("b", 1, n=8, start=20, arrival=1.0)
    c = req("c", 1, n=8, start=30, arrival=2.0)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    top = req("top", 5, n=38, start=40, arrival=4.0)
    sched.add_request(top)
    assert preempt(sched) == [c, b, a]  # the lowest rank, the newest first
    assert sched.running == []
    assert sched.priority.by_priority[1].preempted == 2
    assert sched.priority.by_priority[2].preempted == 1
    assert sched.stats.preemptions == 3


def test_equal_ranks_are_not_retracted(tokenizer: Tokenizer) -> None:
    sched, lows = running_lows(tokenizer)
    sched.add_request(req("same", 1, start=50))
    assert preempt(sched) == []
    assert sched.running == lows and sched.stats.preemptions == 0


def test_a_lower_waiting_rank_retracts_nothing(tokenizer: Tokenizer) -> None:
    sched, lows = running_lows(tokenizer)
    sched.add_request(req("lower", 0, start=50))
    assert preempt(sched) == []
    assert sched.running == lows


def test_the_first_of_the_highest_rank_waiting_decides(tokenizer: Tokenizer) -> None:
    sched, lows = running_lows(tokenizer)
    sched.add_request(req("lower", 0, start=50))
    sched.add_request(req("top", 5, start=60))
    assert preempt(sched) == [lows[1]]


def test_preemption_with_a_step_in_flight(tokenizer: Tokenizer) -> None:
    """It would retract, but a step is in flight: RetractionNeeded, and the step is counted
    once (the engine plans it again after the commit)."""
    sched, lows = running_lows(tokenizer)
    step(sched)
    step(sched)
    sched.add_request(req("top", 5, start=50))
    before = sched.priority.step
    assert before == 3
    with pytest.raises(RetractionNeeded):
        preempt(sched, False)
    assert sched.priority.step == before
    assert sched.running == lows
    sched._scheduled = {}
    assert sched.priority.preempt(sched) == [lows[1]]  # retracting by default
    assert sched.priority.step == before + 1


def test_no_retraction_needed_when_it_fits_or_nothing_ranks_lower(tokenizer: Tokenizer) -> None:
    sched, lows = running_lows(tokenizer, running=3)
    sched.add_request(req("top", 5, start=50))
    assert preempt(sched, False) == []  # it fits
    sched, lows = running_lows(tokenizer)
    sched.add_request(req("same", 1, start=50))
    assert preempt(sched, False) == []  # nothing lower


def test_steps_are_counted_and_nothing_retracted_when_paused_or_idle(
    tokenizer: Tokenizer,
) -> None:
    sched, lows = running_lows(tokenizer)
    n = sched.priority.step
    sched.add_request(req("top", 5, start=50))
    sched.paused = True
    assert preempt(sched) == []
    assert sched.running == lows and sched.priority.step == n + 1
    idle = make(tokenizer)
    idle.add_request(req("top", 5))
    assert preempt(idle) == [] and idle.priority.step == 1
    empty_queue, lows = running_lows(tokenizer)
    assert preempt(empty_queue) == []
    off, lows = running_lows(tokenizer, enable_priority_scheduling=False)
    off.add_request(req("top", 5, start=50))
    assert preempt(off) == [] and off.running == lows
    assert off.priority.step == 2  # its first step, and this one
