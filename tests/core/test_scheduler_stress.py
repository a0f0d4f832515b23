"""Scheduler stress: seeded random traffic (arrivals, aborts, n>1 siblings, identical and
shared-prefix prompts, chunked prefill) against a pool a few requests large, through EngineCore
on a tiny random Llama, with overlap scheduling off and on and page sizes 1 and 16.

After every step: KV accounting balances; the loop made progress (a batch ran or a request
ended); no request waits while nothing runs. At the end every request is done, each got all its
tokens unless the test aborted it, and identical greedy prompts gave identical outputs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from platform_choice import CPU, on_cpu
from scheduler_checks import check_accounting, greedy, tokens

from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, ReqState

POOL = 160  # tokens: room for three or four of these requests at once
MAX_STEPS = 3000
ARRIVAL_STEPS = 120  # steps during which requests arrive


def _traffic_step(rng: random.Random, core: EngineCore, reqs: list[Req], shared: list[int],
                  serial: list[int]) -> None:  # fmt: skip
    """Maybe add a few requests and maybe abort one."""
    for _ in range(rng.choice([0, 0, 1, 2, 4])):
        kind = rng.random()
        if kind < 0.3:  # one of a few prompts, over and over: identical and repeated prompts
            ids = shared + tokens(rng.randrange(4), 6)
        elif kind < 0.6:  # a shared prefix, a fresh tail
            ids = shared + tokens(rng.randrange(10_000), rng.randrange(1, 30))
        else:
            ids = tokens(rng.randrange(10_000), rng.randrange(1, 40))
        siblings = rng.choice([1, 1, 1, 4])  # n>1: the choices arrive together
        max_new = rng.randrange(0, 24)
        for _ in range(siblings):
            serial[0] += 1
            req = Req(f"r{serial[0]}", list(ids), greedy(max_new))
            core.add_request(req)
            reqs.append(req)
    live = [r for r in reqs if not r.finished]
    if live and rng.random() < 0.05:
        core.abort(rng.choice(live).rid)


@pytest.mark.parametrize(
    ("seed", "conservativeness"),
    [(0, 0.0), (1, 1.0)],
    ids=["no-reserve", "default-reserve"],  # 0: admission keeps nothing back, so it retracts
)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_random_traffic_keeps_every_invariant(
    tiny_llama_dir: Path, seed: int, conservativeness: float, page_size: int, overlap: bool
) -> None:
    rng = random.Random(seed)
    config = EngineConfig(
        max_total_tokens=POOL,
        page_size=page_size,
        chunked_prefill_size=24,
        max_running_requests=8,
        schedule_conservativeness=conservativeness,
        enable_overlap_schedule=overlap,
        disable_overlap_schedule=not overlap,
        plugins=(CPU,),
    )
    core = EngineCore(tiny_llama_dir, config, default_host())
    sched = core.scheduler
    shared = tokens(7, 20)
    reqs: list[Req] = []
    serial = [0]
    idle_with_waiting = 0
    for step in range(MAX_STEPS):
        if step < ARRIVAL_STEPS:
            _traffic_step(rng, core, reqs, shared, serial)
        if not core.has_work():
            if step >= ARRIVAL_STEPS:
                break
            continue
        steps_before = sched.stats.steps
        unfinished_before = sum(not r.finished for r in reqs)
        retractions_before = {r.rid: r.num_retractions for r in reqs}
        core.step()
        check_accounting(core)
        for req in reqs:  # no churn: what is retracted waits at least until the next step
            if req.num_retractions > retractions_before[req.rid]:
                assert req not in sched.running, f"{req} re-admitted in its retraction step"
        ran = sched.stats.steps > steps_before
        ended = sum(not r.finished for r in reqs) < unfinished_before
        assert ran or ended or core._in_flight is not None, f"step {step} made no progress"
        if sched.waiting and not sched.running and core._in_flight is None:
            idle_with_waiting += 1
            assert idle_with_waiting < 2, f"requests wait while nothing runs: {sched.waiting}"
        else:
            idle_with_waiting = 0
    else:
        raise AssertionError(f"not idle after {MAX_STEPS} steps: {sched.running}")

    sched.check_no_leak()
    assert len(reqs) > 40
    if conservativeness == 0.0:
        assert sched.stats.retractions > 0, "the pool must be small enough to retract"
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for req in reqs:
        assert req.finished, req
        reason = req.finish_reason
        assert reason is not None
        if reason.type == "abort":
            assert reason.message == "aborted by the client", reason
            continue
        assert len(req.output_ids) == req.sampling.max_new_tokens, req
        key = (*req.input_ids, req.sampling.max_new_tokens)
        outputs = by_prompt.setdefault(key, req.output_ids)
        assert req.output_ids == outputs, "identical greedy prompts gave different outputs"


def _core(model_dir: Path, **settings: object) -> EngineCore:
    config = EngineConfig(disable_overlap_schedule=True, **on_cpu(settings))
    return EngineCore(model_dir, config, default_host())


def test_a_mid_prefill_request_is_retracted_for_running_decodes(tiny_llama_dir: Path) -> None:
    """r0 decodes while r1 is mid-prefill; the pool runs dry (its free slots taken away). The
    newest running request, r1, is retracted although it is not decoding (before, r0 was, and
    r1 was left alone unable to extend: the loop spun)."""
    core = _core(tiny_llama_dir, max_total_tokens=160, chunked_prefill_size=100)
    alloc = core.runner.allocator
    r0 = Req("r0", tokens(400, 60), greedy(8))
    r1 = Req("r1", tokens(401, 60), greedy(8))
    core.add_request(r0)
    core.add_request(r1)
    core.step()
    assert r0.state == ReqState.DECODE and r1.state == ReqState.PREFILL and r1.kv_len == 40
    stolen = alloc.alloc(alloc.available())
    assert stolen is not None
    core.step()
    assert r1.num_retractions == 1 and r1.state == ReqState.WAITING
    assert r0.state == ReqState.DECODE and len(r0.output_ids) == 2
    alloc.free(stolen)
    for _ in range(100):
        if not core.has_work():
            break
        core.step()
        check_accounting(core)
    assert [len(r.output_ids) for r in (r0, r1)] == [8, 8]


@pytest.mark.parametrize("page_size", [1, 16])
def test_an_output_budget_past_the_pool_ends_with_length(
    tiny_llama_dir: Path, page_size: int
) -> None:
    """A request whose prompt fits the pool but whose max_new_tokens does not: its budget is
    cut to the pool (as SGLang does), so it ends with "length" once it fills it, not with an
    abort (which the server answered as a 200 with finish_reason "abort")."""
    core = _core(tiny_llama_dir, max_total_tokens=160, page_size=page_size)
    usable = core.runner.allocator.size
    req = Req("r", tokens(403, 100), greedy(400))
    core.add_request(req)
    while core.has_work():
        core.step()
    assert req.finish_reason is not None and req.finish_reason.type == "length", req.finish_reason
    assert len(req.output_ids) == usable - 100
    core.scheduler.check_no_leak()


def test_a_lone_prefill_that_cannot_extend_ends_with_a_reason(tiny_llama_dir: Path) -> None:
    """The only running request is mid-prefill and the pool cannot give it its next chunk even
    with the cache evicted: it ends with a reason instead of an endless run of empty steps."""
    core = _core(tiny_llama_dir, max_total_tokens=160, chunked_prefill_size=16)
    alloc = core.runner.allocator
    req = Req("r", tokens(402, 60), greedy(4))
    core.add_request(req)
    core.step()
    assert req.state == ReqState.PREFILL and req.kv_len == 16
    stolen = alloc.alloc(alloc.available())
    assert stolen is not None
    assert core.step() == [req]
    assert req.finish_reason is not None and req.finish_reason.type == "abort"
    assert req.finish_reason.message == "KV pool too small for this request"
    assert not core.has_work()
    alloc.free(stolen)
    core.scheduler.check_no_leak()
