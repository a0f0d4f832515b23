"""Priority scheduling (core/priority.py): with the KV pool full of low-priority streams a
high-priority request's time to first token, counted in engine steps, stays within twice
its time on an idle engine, and every low-priority request still finishes; aging bounds how
long a low priority waits under a stream of higher ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from platform_choice import on_cpu
from scheduler_checks import check_accounting, greedy, run_to_idle, tokens

from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.plugins import default_host
from radixserve.core.request import Req
from radixserve.core.step_plan import RetractionNeeded

LOW_STREAMS = 6
LOW_OUTPUT = 60


def make_core(model_dir: Path, **settings: object) -> EngineCore:
    settings.setdefault("max_total_tokens", 512)
    settings.setdefault("max_running_requests", 8)
    settings.setdefault("schedule_policy", "fcfs")
    return EngineCore(model_dir, EngineConfig(**on_cpu(settings)), default_host())


def steps_to_first_token(core: EngineCore, req: Req) -> int:
    """Engine steps from queueing ``req`` to its first output token."""
    core.add_request(req)
    for steps in range(1, 1000):
        core.step()
        check_accounting(core)
        if req.output_ids:
            return steps
    raise AssertionError("no first token")


def high(rid: str) -> Req:
    req = Req(rid, tokens(7, 48), greedy(4))
    req.priority = 10
    return req


def fill_with_low_streams(core: EngineCore) -> list[Req]:
    """Low-priority streams (priority 0) that, decoding, hold the whole pool."""
    lows = [Req(f"low-{i}", tokens(100 + i, 80), greedy(LOW_OUTPUT)) for i in range(LOW_STREAMS)]
    for req in lows:
        core.add_request(req)
    probe = high("probe")
    for _ in range(400):
        core.step()
        check_accounting(core)
        running = core.scheduler.running
        if len(running) >= 3 and all(r.output_ids for r in running):
            if not core.scheduler.would_fit(probe):
                return lows
    raise AssertionError("the low-priority streams never filled the pool")


def ttft_under_load(model_dir: Path, **settings: object) -> tuple[int, int, EngineCore, list[Req]]:
    core = make_core(model_dir, **settings)
    idle = steps_to_first_token(core, high("idle"))
    run_to_idle(core)
    core.flush_cache()  # the loaded run computes its prompt again, as the idle one did
    lows = fill_with_low_streams(core)
    if core.scheduler.priority.enabled:
        # with a step in flight (overlap) the scheduler asks for it to be committed first
        waiting = high("in-flight")
        core.scheduler.add_request(waiting)
        with pytest.raises(RetractionNeeded):
            core.scheduler.schedule(allow_retract=False)
        core.scheduler.waiting.remove(waiting)
    loaded = steps_to_first_token(core, high("loaded"))
    run_to_idle(core)
    return idle, loaded, core, lows


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_high_priority_ttft_within_twice_idle_and_low_ones_finish(
    tiny_llama_dir: Path, overlap: bool
) -> None:
    """With overlap scheduling a step's tokens come one step late, idle and loaded alike; a
    preemption then first commits the step in flight (RetractionNeeded)."""
    idle, loaded, core, lows = ttft_under_load(
        tiny_llama_dir, enable_priority_scheduling=True, enable_overlap_schedule=overlap
    )
    assert loaded <= 2 * idle, (idle, loaded)
    for req in lows:
        assert req.finish_reason is not None and req.finish_reason.type == "length", req.rid
        assert len(req.output_ids) == LOW_OUTPUT
    assert core.scheduler.stats.preemptions > 0
    per_priority = core.scheduler.priority.to_json()
    assert per_priority["0"]["preempted"] > 0
    assert per_priority["10"]["admitted"] == 2  # idle and loaded (the probe never queued)


def test_without_priorities_the_same_request_waits_for_the_streams(tiny_llama_dir: Path) -> None:
    idle, loaded, _, _ = ttft_under_load(tiny_llama_dir)
    assert loaded > 2 * idle, (idle, loaded)


def test_aging_lets_a_low_priority_through_a_stream_of_high_ones(tiny_llama_dir: Path) -> None:
    """One request runs at a time and a new high-priority request arrives every step; the
    low one gains a level per 4 steps waited and runs once it ranks with the newcomers."""
    core = make_core(
        tiny_llama_dir, enable_priority_scheduling=True, max_running_requests=1,
        priority_aging_steps=4,
    )  # fmt: skip
    low = Req("low", tokens(1, 8), greedy(2))
    low.priority = -2
    core.add_request(low)
    before: list[str] = []  # high-priority requests served before the low one
    for step in range(300):
        core.add_request(Req(f"high-{step}", tokens(2 + step, 8), greedy(2)))
        before += [r.rid for r in core.step() if r.finished]
        if low.finished:
            break
    assert low.finish_reason is not None and low.finish_reason.type == "length"
    # Only the high ones that arrived within 2 levels x 4 steps of it go first.
    assert len(before) <= 2 * 4 + 1, before
    run_to_idle(core)


def test_low_priority_values_first(tiny_llama_dir: Path) -> None:
    core = make_core(
        tiny_llama_dir, enable_priority_scheduling=True, schedule_low_priority_values_first=True,
        max_running_requests=1,
    )  # fmt: skip
    first = Req("blocker", tokens(1, 8), greedy(3))
    core.add_request(first)
    core.step()
    reqs = []
    for i, priority in enumerate([5, -1, 3]):
        req = Req(f"p{priority}", tokens(10 + i, 8), greedy(1))
        req.priority = priority
        reqs.append(req)
        core.add_request(req)
    order: list[str] = []
    while core.has_work():
        for req in core.step():
            if req.finished and req.rid != "blocker":
                order.append(req.rid)
    assert order == ["p-1", "p3", "p5"]
