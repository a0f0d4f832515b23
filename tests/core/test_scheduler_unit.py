"""The Scheduler alone, without a model: steps are driven by hand (``schedule``, then the token
the test chooses for each row that samples, then ``process_output``), so every number the
scheduler computes (budgets, chunk sizes, reserves, ratios, slots freed) is checked exactly and
each test runs in milliseconds. The engine-level tests (test_scheduler*.py on the tiny Llama)
check the same paths end to end; these pin the arithmetic that mutation testing probes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from radixserve.core.interfaces import Draft, StepStrategy
from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.core.radix_cache import NoPrefixCache, RadixCache
from radixserve.core.request import FinishReason, Req, ReqState, SamplingParams
from radixserve.core.scheduler import (
    RetractionNeeded,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    new_token_ratios,
    step_kind,
)
from radixserve.core.spec_strategy import Speculation
from radixserve.core.step_plan import StepKindStats, StepPlan
from radixserve.core.stop import StopChecker
from radixserve.core.tokenizer import Tokenizer

EOS = 0  # the tiny Llama's; tests sample TOKEN, never EOS
TOKEN = 7
MAX_STEPS = 400  # a loop that has not ended by then makes no progress


def make(
    tokenizer: Tokenizer,
    *,
    pool: int = 256,
    page: int = 1,
    running: int = 4,
    chunk: int = -1,
    context: int = 128,
    radix: bool = True,
    speculator: Any = None,
    grammar: Any = None,
    **config: Any,
) -> Scheduler:
    config.setdefault("schedule_policy", "fcfs")
    allocator = TokenAllocator(pool, page)
    table = ReqToTokenPool(running + 1, context + 1)
    cache = (RadixCache if radix else NoPrefixCache)(allocator, table)
    return Scheduler(
        SchedulerConfig(
            max_running_requests=running,
            chunked_prefill_size=chunk,
            max_context=context,
            **config,
        ),
        allocator,
        table,
        cache,
        StopChecker(tokenizer, [EOS], context),
        grammar,
        [Speculation(speculator, None, context, False)] if speculator is not None else [],  # type: ignore[arg-type]
    )


def params(max_new_tokens: int = 4, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **kw)


def req(rid: str, n: int, max_new_tokens: int = 4, start: int = 10, **kw: Any) -> Req:
    return Req(rid, list(range(start, start + n)), params(max_new_tokens, **kw))


def add(sched: Scheduler, *reqs: Req) -> None:
    for r in reqs:
        sched.add_request(r)


def sampled_for(sched: Scheduler, batch: StepPlan, token: int = TOKEN) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for i in sched.needs_sampling(batch):
        if i in batch.extra:  # verify entries: accept every draft token, then one more
            out[i] = [(t, None, None) for t in batch.extra[i].tokens] + [(token, None, None)]
        else:
            out[i] = (token, None, None)
    return out


def step(sched: Scheduler, token: int = TOKEN) -> StepPlan | None:
    batch = sched.schedule()
    if batch is not None:
        sched.process_output(batch, sampled_for(sched, batch, token))
    check_accounting(sched)
    return batch


def run_to_idle(sched: Scheduler) -> list[StepPlan]:
    batches = []
    for _ in range(MAX_STEPS):
        if not sched.has_work():
            return batches
        batch = step(sched)
        assert batch is not None or sched.pop_ended() or not sched.running
        if batch is not None:
            batches.append(batch)
    raise AssertionError(f"no progress: {sched.running} {list(sched.waiting)}")


def check_accounting(sched: Scheduler) -> None:
    """Every slot is free, in the tree, or held by a running request past its prefix."""
    acct = sched.kv_accounting()
    p = sched.allocator.page_size
    held = sum(-(-r.kv_len // p) * p - r.prefix_len for r in sched.running)
    assert acct["in_use"] == held, (acct, sched.running)
    assert acct["free"] + acct["evictable"] + acct["locked"] + held == acct["size"]


def shape(batch: StepPlan | None) -> tuple[list[str], list[int], int] | None:
    if batch is None:
        return None
    return [r.rid for r in batch.reqs], batch.extend_lens, batch.num_decode


# -- one step: decodes first, then prefill chunks within the budget ---------------------------


def test_decodes_go_first_and_prefill_chunks_fill_the_rest_of_the_budget(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, chunk=8)
    sched.trace_steps = True
    a, b = req("a", 5, max_new_tokens=10), req("b", 20, start=100)
    add(sched, a)
    assert shape(step(sched)) == (["a"], [5], 0)
    assert a.state == ReqState.DECODE and a.output_ids == [TOKEN]
    add(sched, b)
    assert shape(step(sched)) == (["a", "b"], [1, 7], 1)
    assert sched.stats.step_trace[-1] == (1, 7)
    assert shape(step(sched)) == (["a", "b"], [1, 7], 1)
    assert b.state == ReqState.PREFILL and b.output_ids == [] and b.kv_len == 14
    assert shape(step(sched)) == (["a", "b"], [1, 6], 1)
    assert b.state == ReqState.DECODE and b.output_ids == [TOKEN]
    assert shape(step(sched)) == (["a", "b"], [1, 1], 2)
    assert sched.stats.steps == 5
    assert sched.stats.step_trace == [(0, 5), (1, 7), (1, 7), (1, 6), (2, 0)]


def test_without_chunking_a_prompt_is_one_extend_and_single_token_extends_batch_as_decodes(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, chunk=-1)
    long, one = req("long", 90), req("one", 1, start=200)
    add(sched, long, one)
    batch = sched.schedule()
    # A one-token prompt attends like a decode: it is sorted in front and counted as one.
    assert shape(batch) == (["one", "long"], [1, 90], 1) and batch is not None
    assert sched.needs_sampling(batch) == [0, 1]  # both prompts end here


def test_admission_stops_at_max_running_requests_and_the_budget(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, running=2, chunk=12)
    a, b, c = req("a", 4), req("b", 4, start=40), req("c", 4, start=80)
    add(sched, a, b, c)
    assert shape(step(sched)) == (["a", "b"], [4, 4], 0)
    assert list(sched.waiting) == [c]
    run_to_idle(sched)
    assert [len(r.output_ids) for r in (a, b, c)] == [4, 4, 4]
    # The budget: two prompts of 7 under a budget of 12 are 7 + 5, the second one chunked.
    sched = make(tokenizer, chunk=12)
    add(sched, req("d", 7), req("e", 7, start=40))
    assert shape(step(sched)) == (["d", "e"], [7, 5], 0)
    # A budget that is used up admits nobody else.
    sched = make(tokenizer, chunk=7)
    add(sched, req("f", 7), req("g", 7, start=40))
    assert shape(step(sched)) == (["f"], [7], 0)


def test_a_request_runs_to_max_new_tokens_and_gives_back_every_slot(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=64)
    r = req("r", 10, max_new_tokens=3)
    add(sched, r)
    batches = run_to_idle(sched)
    assert [shape(b) for b in batches] == [(["r"], [10], 0), (["r"], [1], 1), (["r"], [1], 1)]
    assert r.output_ids == [TOKEN] * 3
    assert r.finish_reason == FinishReason("length", length=3)
    assert r.req_pool_idx is None and r.kv_len == 0 and not sched.running
    acct = sched.kv_accounting()
    # The prompt and the first two outputs are cached; the last output has no KV.
    assert acct["evictable"] == 12 and acct["free"] == 64 - 12 and acct["in_use"] == 0
    sched.check_no_leak()
    assert sched.stats.prompt_tokens == 10 and sched.stats.cached_tokens == 0


def test_max_new_tokens_zero_ends_at_the_prompts_end_without_sampling(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, chunk=4)
    r = req("r", 6, max_new_tokens=0)
    add(sched, r)
    batch = sched.schedule()
    assert batch is not None and sched.needs_sampling(batch) == []
    assert sched.process_output(batch, {}) == []  # a prefill chunk: nothing to report
    assert r.state == ReqState.PREFILL and r.kv_len == 4
    batch = sched.schedule()
    assert batch is not None and batch.extend_lens == [2] and sched.needs_sampling(batch) == []
    assert sched.process_output(batch, {}) == [r]
    assert r.finish_reason == FinishReason("length", length=0) and r.output_ids == []
    assert not sched.has_work() and sched.schedule() is None


def test_the_context_length_ends_decoding(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, context=16)
    r = req("r", 12, max_new_tokens=100)
    add(sched, r)
    run_to_idle(sched)
    assert len(r.input_ids) + len(r.output_ids) == 16
    assert r.finish_reason is not None and r.finish_reason.type == "length"


# -- abort, ended, pause ----------------------------------------------------------------------


def test_abort_in_each_state_and_of_an_unknown_rid(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, running=1, pool=64)
    running, waiting = req("run", 8, max_new_tokens=20), req("wait", 8, start=50)
    add(sched, running, waiting)
    step(sched)
    assert sched.abort("nobody") is None
    assert sched.abort("wait", "client left") is waiting
    assert waiting.finish_reason == FinishReason("abort", message="client left")
    assert not sched.waiting
    assert sched.abort("run") is running
    assert running.finish_reason == FinishReason("abort", message="aborted by the client")
    assert running.req_pool_idx is None and not sched.running and not sched.has_work()
    check_accounting(sched)
    sched.check_no_leak()


def test_paused_admits_nothing_while_running_requests_go_on(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    a, b = req("a", 4, max_new_tokens=3), req("b", 4, start=50)
    add(sched, a)
    step(sched)
    sched.paused = True
    add(sched, b)
    while a.state != ReqState.FINISHED:
        batch = step(sched)
        assert batch is not None and [r.rid for r in batch.reqs] == ["a"]
    assert sched.schedule() is None and list(sched.waiting) == [b] and sched.has_work()
    sched.paused = False
    run_to_idle(sched)
    assert len(b.output_ids) == 4


def test_pop_ended_returns_each_ended_request_once(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=32, chunk=8)
    r = req("r", 30)
    add(sched, r)
    step(sched)
    stolen = sched.allocator.alloc(sched.allocator.available())
    assert stolen is not None
    assert sched.schedule() is None  # the lone prefill cannot extend: it ends, with a reason
    assert r.finish_reason == FinishReason("abort", message="KV pool too small for this request")
    assert sched.pop_ended() == [r] and sched.pop_ended() == []
    assert not sched.has_work()
    sched.allocator.free(stolen)
    sched.check_no_leak()


def test_the_request_admission_stopped_at_is_the_one_ended_as_too_big(
    tokenizer: Tokenizer,
) -> None:
    """lpm tries the request with the longer cached prefix first. Here that one can never fit
    (a grammar's jump-forward tokens took it past the pool). The engine must end it, not the
    small request that came first and fits."""
    sched = make(tokenizer, pool=32, schedule_policy="lpm")
    shared = list(range(100, 120))
    add(sched, Req("warm", [*shared, 5], params(1)))
    run_to_idle(sched)  # the shared prefix is cached
    small = req("small", 3, max_new_tokens=2)
    big = Req("big", [*shared, 6, 7, 8], params(30))
    for t in range(10, 22):  # forced tokens, appended before admission as a grammar does
        sched.stop_checker.append(big, t)
    add(sched, small, big)
    assert big.seq_len > sched.allocator.size
    assert sched.schedule() is None and sched.blocked is big
    ended = sched.end_unschedulable()
    assert ended == [big] and big.finish_reason is not None
    assert big.finish_reason.message == "the request does not fit in the KV pool"
    assert small.finish_reason is None and list(sched.waiting) == [small]
    run_to_idle(sched)
    assert len(small.output_ids) == 2
    sched.check_no_leak()


def test_nothing_is_ended_when_admission_did_not_stop_at_a_request(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=32)
    sched.paused = True
    add(sched, req("a", 4))
    assert sched.schedule() is None and sched.blocked is None
    sched.paused = False  # unpaused before the engine looks: still nothing to end
    assert sched.end_unschedulable() == []
    run_to_idle(sched)


def test_check_no_leak_names_slots_and_locks_left_at_idle(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=32)
    sched.check_no_leak()
    assert sched.kv_accounting() == {
        "size": 32, "free": 32, "evictable": 0, "locked": 0, "pinned": 0, "in_use": 0
    }  # fmt: skip
    stolen = sched.allocator.alloc(3)
    assert stolen is not None
    assert sched.kv_accounting()["in_use"] == 3
    with pytest.raises(AssertionError, match="KV leak at idle"):
        sched.check_no_leak()
    sched.allocator.free(stolen)
    add(sched, req("r", 6, max_new_tokens=1))
    run_to_idle(sched)
    node = sched.cache.match_prefix(list(range(10, 16)))[1]
    sched.cache.inc_lock_ref(node)
    with pytest.raises(AssertionError, match="still locked"):
        sched.check_no_leak()


# -- KV slots for prompts whose KV arrives from elsewhere, and freeing them (core/kv_slots.py)


def cached_pages(tokenizer: Tokenizer) -> Scheduler:
    """Pages of 4 slots, 4 pages: two finished prompts hold one page each in the cache (the
    least recently used first), two pages are free."""
    sched = make(tokenizer, pool=19, page=4, running=4)
    add(sched, req("a", 4, max_new_tokens=1), req("b", 4, max_new_tokens=1, start=50))
    run_to_idle(sched)
    assert sched.kv_accounting() == {
        "size": 16, "free": 8, "evictable": 8, "locked": 0, "pinned": 0, "in_use": 0
    }  # fmt: skip
    return sched


def test_a_reserved_prompt_evicts_the_cache_for_exactly_its_pages(tokenizer: Tokenizer) -> None:
    sched = cached_pages(tokenizer)
    rows = sched.req_to_token.available()
    r = req("c", 13, start=80)  # 4 pages: both cached ones are evicted
    slots = sched.reserve_prompt(r, held=0)
    assert slots is not None and len(slots) == 13
    assert r.req_pool_idx is not None and sched.req_to_token.available() == rows - 1
    assert torch.equal(sched.req_to_token.table[r.req_pool_idx, :13], slots)
    assert sched.kv_accounting()["free"] == 0 and sched.cache.evictable_size == 0
    sched.free_reserved(r)  # its KV never arrived
    assert r.req_pool_idx is None
    assert sched.req_to_token.available() == rows
    assert sched.allocator.available() == 16
    sched.free_reserved(r)  # again: nothing left to give back
    assert sched.allocator.available() == 16 and sched.req_to_token.available() == rows


def test_a_reserved_prompt_evicts_only_what_it_needs(tokenizer: Tokenizer) -> None:
    sched = cached_pages(tokenizer)
    r = req("c", 9, start=80)  # 3 pages: one cached page goes, the newer one stays
    assert sched.reserve_prompt(r, held=0) is not None
    assert sched.cache.evictable_size == 4 and sched.allocator.available() == 0
    assert sched.cache.match_prefix(list(range(50, 54)))[0].numel() == 4  # b's prompt stays


def test_a_prompt_the_pool_cannot_hold_gets_no_row(tokenizer: Tokenizer) -> None:
    sched = cached_pages(tokenizer)
    rows = sched.req_to_token.available()
    r = req("c", 17, start=80)  # 5 pages of 4
    assert sched.reserve_prompt(r, held=0) is None
    assert r.req_pool_idx is None and sched.req_to_token.available() == rows
    sched.check_no_leak()
    taken = [sched.req_to_token.alloc() for _ in range(rows)]  # the row it took came back
    assert None not in taken and len(set(taken)) == rows


def test_reserved_prompts_count_against_the_running_limit(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=64, running=3)
    a = req("a", 4)
    assert sched.reserve_prompt(a, held=2) is not None
    sched.free_reserved(a)
    assert sched.reserve_prompt(req("b", 4), held=3) is None
    add(sched, req("c", 4, max_new_tokens=8, start=40))
    step(sched)
    assert len(sched.running) == 1
    assert sched.reserve_prompt(req("d", 4), held=2) is None
    assert sched.reserve_prompt(req("e", 4), held=1) is not None


def test_alloc_positions_evicts_the_cache_unless_told_not_to(tokenizer: Tokenizer) -> None:
    sched = cached_pages(tokenizer)
    r = req("c", 4, max_new_tokens=20, start=80)
    add(sched, r)
    step(sched)  # its prompt: a third page
    assert sched.allocator.available() == 4
    assert not sched.alloc_positions(r, 5, 8, evict=False)  # 2 pages more: 1 free
    assert sched.cache.evictable_size == 8
    assert sched.alloc_positions(r, 5, 8)  # evicting the cache
    assert sched.cache.evictable_size == 4 and sched.allocator.available() == 0


def test_release_gives_back_a_running_requests_row_to_the_cache(tokenizer: Tokenizer) -> None:
    seen: list[tuple[Any, str]] = []

    class Watch(StepStrategy):
        def on_release(self, scheduler: Any, req: Any) -> None:
            seen.append((scheduler, req.rid))

    sched = make(tokenizer, pool=64)
    sched.strategies.append(Watch())
    rows = sched.req_to_token.available()
    r = req("a", 6, max_new_tokens=20)
    add(sched, r)
    step(sched)
    sched.release(r)
    assert seen == [(sched, "a")]
    assert sched.running == [] and r.req_pool_idx is None and r.kv_len == 0
    assert sched.req_to_token.available() == rows
    assert sched.cache.evictable_size == 6
    sched.check_no_leak()


# -- KV pressure: retraction and its ratio ----------------------------------------------------


def test_the_newest_request_is_retracted_and_the_ratio_jumps_to_what_decodes_showed(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, pool=40, radix=False, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    old, new = req("old", 10, max_new_tokens=30), req("new", 10, max_new_tokens=30, start=60)
    add(sched, old, new)
    step(sched)
    while not sched.stats.retractions:
        assert step(sched) is not None
    assert new.state == ReqState.WAITING and new.num_retractions == 1 and new.kv_len == 0
    assert list(sched.waiting) == [new] and sched.running == [old]
    assert old.num_retractions == 0
    # init ratio 0 (--schedule-conservativeness 0): retraction keeps the ratio at 0.
    assert sched.new_token_ratio == 0.0
    run_to_idle(sched)
    assert len(old.output_ids) == len(new.output_ids) == 30


@pytest.mark.parametrize("init", [0.5, 0.9])
def test_the_ratio_after_a_retraction(tokenizer: Tokenizer, init: float) -> None:
    """(decoded + 20 per running request) / (allowed + 1), at least init, at most 1."""
    sched = make(tokenizer, init_new_token_ratio=init)
    a, b = req("a", 4, max_new_tokens=99), req("b", 4, max_new_tokens=60, start=50)
    c = req("c", 4, max_new_tokens=10, start=90)
    add(sched, a, b, c)
    for _ in range(5):
        step(sched)
    sched._retract(c)
    estimate = (5 + 5 + 20 * 2) / (99 + 60 + 1)  # 0.3125
    assert sched.new_token_ratio == pytest.approx(max(estimate, init))
    assert sched.stats.retractions == 1 and c.num_retractions == 1
    sched._retract(b)  # a alone: (5 + 20) / 100
    assert sched.new_token_ratio == pytest.approx(max(0.25, init))
    a.sampling.max_new_tokens = 10
    sched._retract(a)  # nobody left: 0 / 1, then at least init
    assert sched.new_token_ratio == pytest.approx(init)
    sched2 = make(tokenizer, init_new_token_ratio=0.8)
    d = req("d", 4, max_new_tokens=10)
    add(sched2, d, req("e", 4, start=50))
    step(sched2)
    sched2._retract(sched2.running[1])  # (1 + 20) / 11 > 1: capped
    assert sched2.new_token_ratio == 1.0


def test_the_ratio_decays_each_step_without_retraction_down_to_its_floor(
    tokenizer: Tokenizer,
) -> None:
    sched = make(
        tokenizer, init_new_token_ratio=0.5, min_new_token_ratio=0.1, new_token_ratio_decay_steps=4
    )
    add(sched, req("r", 4, max_new_tokens=20))
    seen = []
    for _ in range(6):
        step(sched)
        seen.append(sched.new_token_ratio)
    assert seen == pytest.approx([0.4, 0.3, 0.2, 0.1, 0.1, 0.1])
    sched = make(tokenizer, init_new_token_ratio=0.5, min_new_token_ratio=0.1)
    step(sched)  # an empty step decays too
    assert sched.new_token_ratio == pytest.approx(0.5 - 0.4 / 600)
    sched = make(tokenizer, init_new_token_ratio=0.5, new_token_ratio_decay_steps=0)
    step(sched)  # 0 steps: decays by the whole span at once (no division by zero)
    assert sched.new_token_ratio == pytest.approx(sched.config.min_new_token_ratio)


def test_new_token_ratios_follow_schedule_conservativeness() -> None:
    assert new_token_ratios(1.0) == pytest.approx(
        {"init_new_token_ratio": 0.7, "min_new_token_ratio": 0.098}
    )
    assert new_token_ratios(0.5) == pytest.approx(
        {"init_new_token_ratio": 0.35, "min_new_token_ratio": 0.049}
    )
    assert new_token_ratios(2.0) == pytest.approx(
        {"init_new_token_ratio": 1.0, "min_new_token_ratio": 0.14}
    )
    defaults = SchedulerConfig(1, -1, "fcfs", 8)
    assert defaults.init_new_token_ratio == 0.7 and defaults.min_new_token_ratio == 0.098
    assert defaults.new_token_ratio_decay_steps == 600
    assert defaults.shared_prefill_min_tokens == 32 and defaults.random_seed == 0


def test_without_retraction_allowed_kv_pressure_raises(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=24, radix=False, init_new_token_ratio=0.0)
    a, b = req("a", 10, max_new_tokens=30), req("b", 10, max_new_tokens=30, start=60)
    add(sched, a, b)
    step(sched)
    while sched.allocator.available() >= 2:
        step(sched)
    with pytest.raises(RetractionNeeded):
        sched.schedule(allow_retract=False)
    assert sched.stats.retractions == 0 and len(sched.running) == 2
    batch = sched.schedule()
    assert batch is not None and [r.rid for r in batch.reqs] == ["a"]
    assert sched.stats.retractions == 1


def test_a_lone_decode_the_pool_cannot_hold_ends_with_a_reason(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=16, radix=False)
    r = req("r", 10, max_new_tokens=30)
    add(sched, r)
    step(sched)
    stolen = sched.allocator.alloc(sched.allocator.available())
    assert stolen is not None
    assert sched.schedule() is None
    assert r.finish_reason == FinishReason("abort", message="KV pool too small for this request")
    assert sched.pop_ended() == [r] and not sched.running and sched.stats.retractions == 0


def test_stalled_prefills_retract_the_newest_and_no_one_is_admitted_that_step(
    tokenizer: Tokenizer,
) -> None:
    """a is back in PREFILL (jump-forward tokens to extend over) while b is mid-prefill; the
    pool is empty: the newest, b, is retracted, a extends over b's freed slots, and b is not
    re-admitted into the same shortage in that step."""
    sched = make(tokenizer, pool=64, chunk=8, radix=False, grammar=FakeStepper([61, 62]))
    a, b = req("a", 5, max_new_tokens=10), req("b", 30, start=60)
    a.grammar = object()
    add(sched, a, b)
    assert shape(step(sched)) == (["a", "b"], [5, 3], 0)
    assert shape(step(sched, token=42)) == (["a", "b"], [1, 7], 1)
    assert a.state == ReqState.PREFILL and a.output_ids == [TOKEN, 42, 61, 62]
    assert b.state == ReqState.PREFILL and b.kv_len == 10
    stolen = sched.allocator.alloc(sched.allocator.available())
    assert stolen is not None
    batch = sched.schedule()
    assert b.num_retractions == 1 and b.state == ReqState.WAITING and b.kv_len == 0
    assert shape(batch) == (["a"], [3], 0) and list(sched.waiting) == [b]
    assert batch is not None
    sched.process_output(batch, sampled_for(sched, batch))
    sched.allocator.free(stolen)
    run_to_idle(sched)
    assert len(a.output_ids) == 10 and len(b.output_ids) == 4


# -- admission: the reserve for running requests' future tokens -------------------------------


@pytest.mark.parametrize(("prompt", "fits"), [(43, True), (44, False)])
def test_admission_keeps_the_running_requests_share_of_future_tokens(
    tokenizer: Tokenizer, prompt: int, fits: bool
) -> None:
    """Ratio 0.5. The runner (8 prompt tokens, 1 of 16 out) has 55 slots free beside it once
    its decode slot is taken, and reserves 0.5 * 15 = 7.5 more: room 47.5. A newcomer needs
    its prompt and 0.5 * 9 of its own: 43 + 4.5 fits exactly, 44 + 4.5 does not."""
    sched = make(
        tokenizer,
        pool=64,
        radix=False,
        init_new_token_ratio=0.5,
        min_new_token_ratio=0.5,
    )
    runner = req("runner", 8, max_new_tokens=16)
    add(sched, runner)
    step(sched)
    late = req("late", prompt, max_new_tokens=9, start=100)
    add(sched, late)
    batch = sched.schedule()
    assert batch is not None
    assert ("late" in [r.rid for r in batch.reqs]) == fits
    assert sched.waiting.count(late) == (0 if fits else 1)
    assert (late.req_pool_idx is not None) == fits  # a refused one gives its row back


def test_the_first_request_is_admitted_without_a_reserve(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=32, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    r = req("r", 20, max_new_tokens=100)  # 20 + 100 > 32: only the reserve would refuse it
    add(sched, r)
    assert shape(step(sched)) == (["r"], [20], 0)


def test_a_request_that_does_not_fit_keeps_its_place_and_stops_admission(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, pool=40, radix=False, init_new_token_ratio=0.0)
    add(sched, req("a", 20, max_new_tokens=8))
    step(sched)
    big, small = req("big", 30, start=100), req("small", 2, start=200)
    add(sched, big, small)
    batch = step(sched)
    assert batch is not None and [r.rid for r in batch.reqs] == ["a"]  # fcfs: small waits too
    assert list(sched.waiting) == [big, small]
    assert big.req_pool_idx is None and sched.req_to_token.available() == 4


# -- the prefix cache at admission -------------------------------------------------------------


def test_the_last_prompt_token_and_scored_positions_never_come_from_the_cache(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer)
    add(sched, req("warm", 20, max_new_tokens=1))
    run_to_idle(sched)
    same = req("same", 20)
    scored = req("scored", 20)
    scored.logprob_start_len = 6  # positions 5.. give prompt logprobs: 5 tokens from cache
    add(sched, same, scored)
    batch = step(sched)
    assert batch is not None and batch.extend_lens == [1, 15]
    assert (same.cached_tokens, scored.cached_tokens) == (19, 5)
    assert sched.stats.prompt_tokens == 60 and sched.stats.cached_tokens == 24
    assert sched.stats.cache_hit_rate == pytest.approx(24 / 60)
    assert SchedulerStats().cache_hit_rate == 0.0


def test_pooling_requests_neither_read_nor_fill_the_cache(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    add(sched, req("warm", 20, max_new_tokens=1))
    run_to_idle(sched)
    cached = sched.cache.total_size()
    emb = req("emb", 20, max_new_tokens=0, start=400)
    emb.pooling = "last"
    add(sched, emb)
    batch = step(sched)
    assert batch is not None and batch.extend_lens == [20] and emb.cached_tokens == 0
    assert emb.finished and sched.cache.total_size() == cached
    sched.check_no_leak()
    # An embedding request does not wait for a running prefill of the same prompt either.
    sched = make(tokenizer, chunk=8)
    gen, emb = req("gen", 40), req("emb", 40, max_new_tokens=0)
    emb.pooling = "mean"
    add(sched, gen, emb)
    step(sched)
    batch = step(sched)
    assert batch is not None and [r.rid for r in batch.reqs] == ["gen"]  # budget 8: gen's
    assert sched.stats.deferred_admissions == 0


def test_identical_prompts_wait_for_the_running_prefill_and_then_hit_the_cache(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, chunk=32)
    first, second = req("first", 40), req("second", 40)
    add(sched, first, second)
    steps = 0
    while second.state == ReqState.WAITING:
        step(sched)
        steps += 1
    # Step 1: first's 32 use the budget; step 2: second waits for first's last 8; step 3:
    # first's prompt is cached and second takes all but its last token from there.
    assert steps == 3 and sched.stats.deferred_admissions == 1
    assert second.cached_tokens == 39 and first.cached_tokens == 0
    # Another namespace (extra_key) shares nothing: no wait.
    sched = make(tokenizer, chunk=32)
    other = Req("other", list(range(10, 50)), params(), extra_key="lora-b")
    add(sched, req("first", 40), other)
    step(sched)
    batch = step(sched)
    assert shape(batch) == (["first", "other"], [8, 24], 0)
    assert sched.stats.deferred_admissions == 0


@pytest.mark.parametrize(("shared", "waits"), [(32, True), (31, False)])
def test_a_shared_prefill_is_waited_for_only_from_its_minimum_length(
    tokenizer: Tokenizer, shared: int, waits: bool
) -> None:
    """Both arrive together: first is admitted whole, and second, in the same step, compares
    its first 32 (uncached) tokens with first's."""
    sched = make(tokenizer, chunk=64)
    head = list(range(10, 10 + shared))
    first = Req("first", head + list(range(300, 308)), params())
    second = Req("second", head + list(range(200, 220)), params())
    add(sched, first, second)
    step(sched)
    assert sched.stats.deferred_admissions == (1 if waits else 0)
    assert (second.state == ReqState.WAITING) == waits


def test_a_shared_prefill_span_is_cut_to_whole_pages(tokenizer: Tokenizer) -> None:
    """Pages of 16 and a minimum of 20 shared tokens: the span compared is cut to 16, so a
    prompt sharing one page with a running prefill waits for it."""
    sched = make(tokenizer, chunk=64, page=16, shared_prefill_min_tokens=20)
    head = list(range(10, 26))  # one page in common
    first = Req("first", head + list(range(300, 340)), params())
    second = Req("second", head + list(range(200, 240)), params())
    add(sched, first, second)
    step(sched)
    assert sched.stats.deferred_admissions == 1 and second.state == ReqState.WAITING


# -- disaggregation hooks -----------------------------------------------------------------------


def test_add_running_decodes_from_kv_it_did_not_compute(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=64)
    released: list[str] = []

    class Releases(StepStrategy):
        def on_release(self, scheduler: Any, req: Any) -> None:
            assert req.req_pool_idx is not None  # called while its slots are still held
            released.append(req.rid)

    sched.strategies.append(Releases())
    r = req("r", 10, max_new_tokens=3)
    row = sched.req_to_token.alloc()
    slots = sched.allocator.alloc(10)
    assert row is not None and slots is not None
    sched.req_to_token.write(row, 0, slots)
    r.req_pool_idx, r.kv_len, r.state = row, 10, ReqState.DECODE
    sched.stop_checker.append(r, TOKEN)  # the first token came with the KV
    sched.add_running(r)
    assert sched.running == [r] and sched.cache.total_size() == 10
    assert shape(step(sched)) == (["r"], [1], 1)
    run_to_idle(sched)
    assert r.output_ids == [TOKEN] * 3 and released == ["r"]
    sched.check_no_leak()
    done = req("done", 10, max_new_tokens=1)
    row = sched.req_to_token.alloc()
    slots = sched.allocator.alloc(10)
    assert row is not None and slots is not None
    sched.req_to_token.write(row, 0, slots)
    done.req_pool_idx, done.kv_len, done.state = row, 10, ReqState.DECODE
    sched.stop_checker.append(done, TOKEN)
    assert done.finished
    sched.add_running(done)
    assert not sched.running and done.req_pool_idx is None and released == ["r", "done"]
    sched.check_no_leak()


# -- speculation: draft slots, verify entries, commit --------------------------------------------


class FakeSpeculator:
    """Drafts ``draft`` tokens for every request it is asked about (cut to the limit)."""

    name = "fake"
    tree_nodes = 0  # chains only
    adaptive = None  # fixed draft lengths (no --speculative-adaptive)

    def __init__(self, k: int, draft: Sequence[int], fail: bool = False) -> None:
        self.k, self.draft, self.fail = k, list(draft), fail
        self.limits: list[list[int]] = []
        self.verified_calls: list[tuple[list[str], list[int], list[int], int]] = []
        self.released: list[str] = []
        self.forgotten: list[str] = []
        self.algorithm = self

    def draft_length(self, batch_size: int) -> int:
        return self.k

    def wants(self, req: Req) -> bool:
        return req.rid != "plain"

    def tree_nodes_for(self, req: Req, num_drafting: int) -> int:
        return 0

    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[Draft]:
        self.limits.append(list(limits))
        if self.fail:
            raise RuntimeError("drafter down")
        return [Draft(self.draft[:n]) for n in limits]

    def verified(self, reqs: Any, drafted: Any, accepted: Any, batch_size: int) -> None:
        self.verified_calls.append(
            ([r.rid for r in reqs], list(drafted), list(accepted), batch_size)
        )

    def release(self, rid: str) -> None:
        self.released.append(rid)

    def forget(self, rid: str) -> None:
        self.forgotten.append(rid)


def test_verify_entries_extend_over_the_draft_and_commit_the_accepted_tokens(
    tokenizer: Tokenizer,
) -> None:
    spec = FakeSpeculator(3, [21, 22, 23])
    sched = make(tokenizer, pool=64, speculator=spec, chunk=16)
    r, plain = req("r", 6, max_new_tokens=20), req("plain", 4, start=50, max_new_tokens=20)
    add(sched, r, plain)
    step(sched)
    batch = sched.schedule()
    assert batch is not None
    assert shape(batch) == (["plain", "r"], [1, 4], 1)
    assert list(batch.extra) == [1] and batch.extra[1].tokens == [21, 22, 23]
    assert spec.limits == [[3]]
    assert sched.needs_sampling(batch) == [0, 1]
    # The target accepts one draft token and emits its own: the KV of positions 6 (the last
    # token) and 7 (the accepted draft) is kept, that of 8 and 9 goes back.
    free_before = sched.allocator.available()
    changed = sched.process_output(
        batch, {0: (TOKEN, None, None), 1: [(21, None, None), (30, None, None)]}
    )
    assert changed == [plain, r]
    assert r.output_ids == [TOKEN, 21, 30] and r.kv_len == 8 and r.num_pending == 0
    assert sched.allocator.available() == free_before + 2
    assert spec.verified_calls == [(["r"], [3], [1], 2)]
    check_accounting(sched)
    run_to_idle(sched)
    assert len(r.output_ids) == 20 and "r" in spec.released and "r" in spec.forgotten


def test_drafts_are_cut_to_what_the_request_may_still_emit(tokenizer: Tokenizer) -> None:
    spec = FakeSpeculator(8, list(range(21, 29)))
    sched = make(tokenizer, pool=64, speculator=spec, context=24)
    near_len = req("len", 6, max_new_tokens=4)
    near_ctx = req("ctx", 16, max_new_tokens=50, start=40)
    add(sched, near_len, near_ctx)
    step(sched)
    batch = sched.schedule()
    # len: 1 of 4 out, 3 left, the verify emits one more: 2 drafts; ctx: 24 - 17 = 7 left: 6.
    assert spec.limits == [[2, 6]]
    assert batch is not None and batch.extend_lens == [3, 7]
    sched.process_output(batch, sampled_for(sched, batch))
    assert len(near_len.output_ids) == 4 and near_len.finished
    assert len(near_ctx.input_ids) + len(near_ctx.output_ids) == 24 and near_ctx.finished
    sched.check_no_leak()


def test_a_failing_drafter_or_an_empty_draft_leaves_plain_decodes(tokenizer: Tokenizer) -> None:
    for spec in (FakeSpeculator(3, [21, 22, 23], fail=True), FakeSpeculator(3, [])):
        sched = make(tokenizer, pool=64, speculator=spec)
        r = req("r", 6, max_new_tokens=5)
        add(sched, r)
        step(sched)
        free = sched.allocator.available()
        batch = sched.schedule()
        assert batch is not None and shape(batch) == (["r"], [1], 1) and not batch.extra
        assert sched.allocator.available() == free - 1  # the draft slots went back
        sched.process_output(batch, sampled_for(sched, batch))
        run_to_idle(sched)
        assert r.output_ids == [TOKEN] * 5
        sched.check_no_leak()


def test_rejected_draft_slots_are_freed_in_whole_pages_only(tokenizer: Tokenizer) -> None:
    spec = FakeSpeculator(6, [21, 22, 23, 24, 25, 26])
    sched = make(tokenizer, pool=64, page=4, speculator=spec)
    r = req("r", 6, max_new_tokens=30)
    add(sched, r)
    size = sched.allocator.size
    step(sched)  # positions 0..5 in pages [0, 4) and [4, 8)
    batch = sched.schedule()  # verify over positions 6..12: pages up to [12, 16)
    assert batch is not None and batch.extend_lens == [7]
    assert sched.allocator.available() == size - 16
    sched.process_output(batch, {0: [(21, None, None), (40, None, None)]})
    # Kept positions 0..7; the pages [8, 12) and [12, 16) go back.
    assert r.kv_len == 8 and sched.allocator.available() == size - 8
    check_accounting(sched)
    batch = sched.schedule()  # verify over 8..14: pages [8, 12) and [12, 16) again
    assert batch is not None and batch.extend_lens == [7]
    assert sched.allocator.available() == size - 16
    sched.process_output(batch, {0: [(50, None, None)]})  # nothing accepted: keep 0..8
    # Position 8's page stays (it is written into); [12, 16) goes back.
    assert r.kv_len == 9 and sched.allocator.available() == size - 12
    check_accounting(sched)


# -- grammar: rejected tokens and jump-forward ----------------------------------------------------


class FakeStepper:
    """Rejects token 99 (ending the request); forces ``forced`` after token 42."""

    def __init__(self, forced: list[int]) -> None:
        self.forced = forced

    def accept(self, req: Req, token: int) -> bool:
        if token == 99:
            req.finish(FinishReason("abort", message="rejected"))
            return False
        return True

    def after_token(self, req: Req) -> list[int]:
        return list(self.forced) if req.output_ids[-1] == 42 else []


def test_jump_forward_tokens_are_appended_and_extended_over_next_step(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, grammar=FakeStepper([61, 62]))
    r = req("r", 5, max_new_tokens=10)
    r.grammar = object()
    add(sched, r)
    step(sched, token=42)
    assert r.output_ids == [42, 61, 62] and r.state == ReqState.PREFILL
    batch = step(sched)
    assert shape(batch) == (["r"], [3], 0)  # 42, 61, 62 get their KV; the last samples
    assert r.output_ids == [42, 61, 62, TOKEN] and r.state == ReqState.DECODE
    batch = step(sched, token=99)
    assert r.finish_reason == FinishReason("abort", message="rejected")
    assert r.output_ids == [42, 61, 62, TOKEN] and not sched.running
    # Forced tokens stop at the length limit.
    sched = make(tokenizer, grammar=FakeStepper([61, 62, 63]))
    r = req("r", 5, max_new_tokens=2)
    r.grammar = object()
    add(sched, r)
    step(sched, token=42)
    assert r.output_ids == [42, 61] and r.finished and not sched.running
    sched.check_no_leak()


# -- overlap: the next step is scheduled before this one's tokens are committed ------------------


def test_overlapped_steps_count_pending_tokens_and_skip_requests_that_ended_meanwhile(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer)
    a = req("a", 5, max_new_tokens=2)
    b = req("b", 5, max_new_tokens=9, start=50, stop_token_ids=[8])
    c = req("c", 5, max_new_tokens=9, start=90)
    add(sched, a, b, c)
    first = sched.schedule(allow_retract=False)
    assert first is not None
    sched.advance(first)
    assert (a.num_pending, a.seq_len, a.num_output_tokens) == (1, 6, 1)
    second = sched.schedule(allow_retract=False)  # a's pending token is not its last
    assert shape(second) == (["a", "b", "c"], [1, 1, 1], 3) and second is not None
    sched.advance(second)
    assert a.num_output_tokens == 2
    one_each = {i: (TOKEN, None, None) for i in range(3)}
    assert sched.commit(first, one_each) == [a, b, c]
    third = sched.schedule(allow_retract=False)  # a's pending token ends it: no step
    assert shape(third) == (["b", "c"], [1, 1], 2) and third is not None
    sched.advance(third)
    # b's stop token arrives one step late: third, already launched, ran it for nothing.
    changed = sched.commit(second, {0: (TOKEN, None, None), 1: (8, None, None), 2: (9, None, None)})
    assert changed == [a, b, c] and a.finished and a.output_ids == [TOKEN, TOKEN]
    assert b.output_ids == [TOKEN, 8] and b.finish_reason == FinishReason("stop", matched=8)
    # b's token is dropped; c, after it in the batch, gets its own.
    assert sched.commit(third, {0: (TOKEN, None, None), 1: (10, None, None)}) == [c]
    assert b.output_ids == [TOKEN, 8] and c.output_ids == [TOKEN, 9, 10]
    sched.abort("c")
    assert not sched.has_work()
    sched.check_no_leak()


def test_stalled_prefills_with_tokens_pending_raise_instead_of_retracting(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, pool=64, chunk=8, radix=False, grammar=FakeStepper([61, 62]))
    a, b = req("a", 5, max_new_tokens=10), req("b", 30, start=60)
    a.grammar = object()
    add(sched, a, b)
    step(sched)
    step(sched, token=42)
    stolen = sched.allocator.alloc(sched.allocator.available())
    assert stolen is not None
    with pytest.raises(RetractionNeeded):
        sched.schedule(allow_retract=False)
    assert b.num_retractions == 0 and sched.running == [a, b]


def test_no_table_row_or_no_kv_leaves_the_request_waiting_and_unlocks_its_prefix(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, pool=64, running=2)
    add(sched, req("warm", 20, max_new_tokens=1))
    run_to_idle(sched)
    rows = [sched.req_to_token.alloc() for _ in range(3)]
    assert None not in rows and sched.req_to_token.available() == 0
    r = req("r", 30)  # its first 20 tokens are cached
    add(sched, r)
    assert sched.schedule() is None and list(sched.waiting) == [r]
    for row in rows:
        assert row is not None
        sched.req_to_token.free(row)
    stolen = sched.allocator.alloc(sched.allocator.available())
    assert stolen is not None
    sched.cache.inc_lock_ref(sched.cache.match_prefix(list(range(10, 30)))[1])  # not evictable
    assert sched.schedule() is None and list(sched.waiting) == [r]
    assert sched.cache.locked_size == 20  # only our own lock: the admission gave its back
    assert sched.req_to_token.available() == 3 and r.req_pool_idx is None
    sched.allocator.free(stolen)
    sched.cache.dec_lock_ref(sched.cache.match_prefix(list(range(10, 30)))[1])
    run_to_idle(sched)
    assert len(r.output_ids) == 4 and r.cached_tokens == 20
    assert sched.req_to_token.available() == 3  # every row is back, the refused one's too


def test_no_drafts_when_the_policy_says_zero_or_their_slots_do_not_fit(
    tokenizer: Tokenizer,
) -> None:
    spec = FakeSpeculator(0, [21, 22])
    sched = make(tokenizer, speculator=spec)
    add(sched, req("r", 6))
    step(sched)
    batch = step(sched)
    assert batch is not None and not batch.extra and spec.limits == []
    spec = FakeSpeculator(4, [21, 22, 23, 24])
    sched = make(tokenizer, pool=16, radix=False, speculator=spec)
    r = req("r", 10, max_new_tokens=8)
    add(sched, r)
    step(sched)
    stolen = sched.allocator.alloc(sched.allocator.available() - 1)  # room for the decode only
    assert stolen is not None
    batch = sched.schedule()
    assert shape(batch) == (["r"], [1], 1) and spec.limits == [] and batch is not None
    sched.process_output(batch, sampled_for(sched, batch))
    assert r.output_ids == [TOKEN, TOKEN]
    sched.allocator.free(stolen)
    check_accounting(sched)


# -- budget edges ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("chunk", "extends"), [(0, [[5]]), (1, [[1]] * 5)])
def test_chunk_size_zero_means_no_limit_and_one_means_one_token_a_step(
    tokenizer: Tokenizer, chunk: int, extends: list[list[int]]
) -> None:
    sched = make(tokenizer, chunk=chunk)
    add(sched, req("r", 5, max_new_tokens=1))
    assert [b.extend_lens for b in run_to_idle(sched)] == extends


def test_the_last_token_of_the_budget_still_admits_or_extends(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, chunk=4)
    a, b = req("a", 3), req("b", 5, start=40)
    add(sched, a, b)
    assert shape(step(sched)) == (["b", "a"], [1, 3], 1)  # b's chunk is the budget's last token
    sched = make(tokenizer, chunk=3)
    a, b, c = req("a", 1), req("b", 1, start=40), req("c", 9, start=80)
    add(sched, a, b, c)
    assert shape(step(sched)) == (["a", "b", "c"], [1, 1, 1], 3)
    assert shape(step(sched)) == (["a", "b", "c"], [1, 1, 1], 3)  # 3 - 2 decodes: c gets 1
    assert c.kv_len == 2


def test_draft_tokens_come_out_of_the_prefill_budget(tokenizer: Tokenizer) -> None:
    for chunk, c_chunk in ((6, 2), (4, 0)):
        spec = FakeSpeculator(3, [21, 22, 23])
        sched = make(tokenizer, chunk=chunk, speculator=spec)
        a, c = req("a", 1, max_new_tokens=20), req("c", 20, start=80)
        add(sched, a, c)
        step(sched)  # a: 1, c: chunk - 1
        before = c.kv_len
        batch = step(sched)  # a verifies 1 + 3 tokens; c gets what is left
        assert batch is not None and batch.extend_lens[0] == 4
        assert c.kv_len - before == c_chunk
        assert ("c" in [r.rid for r in batch.reqs]) == (c_chunk > 0)


# -- admission details ----------------------------------------------------------------------------


def test_lpm_and_random_order_the_queue_through_the_scheduler(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, schedule_policy="lpm", running=8)
    add(sched, req("warm", 30, max_new_tokens=1))
    run_to_idle(sched)
    none = req("none", 12, start=200)
    other_ns = Req("other-ns", list(range(10, 30)), params(), extra_key="b")  # no match there
    emb = req("emb", 20)
    emb.pooling = "last"  # embeddings match nothing
    short, long = req("short", 12, start=10), req("long", 25, start=10)
    add(sched, none, other_ns, emb, short, long)
    step(sched)
    assert [r.rid for r in sched.running] == ["long", "short", "none", "other-ns", "emb"]
    orders = []
    for _ in range(2):
        sched = make(tokenizer, schedule_policy="random", random_seed=3, running=8)
        add(sched, *[req(f"r{i}", 4, start=20 * i) for i in range(6)])
        step(sched)
        orders.append([r.rid for r in sched.running])
    assert orders[0] == orders[1] and sorted(orders[0]) == [f"r{i}" for i in range(6)]
    assert orders[0] != [f"r{i}" for i in range(6)]


def test_a_cached_prefix_is_not_counted_against_the_reserve_and_evictable_cache_is(
    tokenizer: Tokenizer,
) -> None:
    """Ratio 0. The newcomer's 40 cached tokens are not counted (only its 5 new ones), and
    unrelated cache (evictable) counts as room."""
    sched = make(tokenizer, pool=64, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    add(sched, req("warm", 40, max_new_tokens=1))
    run_to_idle(sched)
    runner = req("runner", 8, start=300)
    add(sched, runner)
    step(sched)  # 64 - 40 cached - 9 = 15 free
    late = req("late", 45)
    add(sched, late)
    batch = sched.schedule()
    assert shape(batch) == (["runner", "late"], [1, 5], 1) and batch is not None
    prefix = sched.cache.match_prefix(list(range(10, 50)))[0]
    assert late.req_pool_idx is not None
    assert sched.req_to_token.table[late.req_pool_idx, :40].tolist() == prefix.tolist()
    sched.process_output(batch, sampled_for(sched, batch))
    run_to_idle(sched)
    # Evictable room: 40 unrelated cached tokens, 15 free, a 30-token newcomer fits.
    sched = make(tokenizer, pool=64, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    add(sched, req("warm", 40, max_new_tokens=1))
    run_to_idle(sched)
    add(sched, req("runner", 8, start=300))
    step(sched)
    late = req("late", 30, start=500)
    add(sched, late)
    batch = step(sched)
    assert batch is not None and "late" in [r.rid for r in batch.reqs]


def test_admission_evicts_only_the_cache_it_needs_least_recently_used_first(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, pool=40)
    for i in range(3):  # three cached prompts of 10, oldest first; 10 slots free
        add(sched, req(f"warm{i}", 10, max_new_tokens=1, start=100 * (i + 1)))
        run_to_idle(sched)
    assert sched.cache.evictable_size == 30
    r = req("r", 20, start=1000, max_new_tokens=1)
    add(sched, r)
    batch = step(sched)
    assert shape(batch) == (["r"], [20], 0)
    kept = [len(sched.cache.match_prefix(list(range(100 * i, 100 * i + 10)))[0]) for i in (1, 2, 3)]
    assert kept == [0, 10, 10]


def test_deferred_requests_are_counted_each_and_do_not_block_the_queue(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, chunk=64)
    first, copy1, copy2 = req("first", 40), req("copy1", 40), req("copy2", 40)
    other = req("other", 10, start=500)
    add(sched, first, copy1, copy2, other)
    batch = step(sched)
    assert shape(batch) == (["first", "other"], [40, 10], 0)
    assert sched.stats.deferred_admissions == 2
    # One shared token is enough when the minimum is 1.
    sched = make(tokenizer, chunk=64, shared_prefill_min_tokens=1)
    add(sched, req("a", 10), Req("b", [10, 500, 501], params()))
    step(sched)
    assert sched.stats.deferred_admissions == 1


def test_a_refused_admission_gives_back_its_row_and_lock(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=64, init_new_token_ratio=0.5, min_new_token_ratio=0.5)
    add(sched, req("warm", 20, max_new_tokens=1))
    run_to_idle(sched)
    runner = req("runner", 8, max_new_tokens=16, start=300)
    add(sched, runner)
    step(sched)
    rows, locked = sched.req_to_token.available(), sched.cache.locked_size
    # Shares warm's 20 tokens: 25 new + 0.5 * 9 > 35 free - 1 (runner's slot) - 0.5 * 15.
    late = req("late", 45, max_new_tokens=9)
    add(sched, late)
    batch = sched.schedule()
    assert batch is not None and [r.rid for r in batch.reqs] == ["runner"]
    assert sched.req_to_token.available() == rows and sched.cache.locked_size == locked
    sched.process_output(batch, sampled_for(sched, batch))
    run_to_idle(sched)
    assert len(late.output_ids) == 9 and len(runner.output_ids) == 16
    sched.check_no_leak()


@pytest.mark.parametrize(("prompt", "fits"), [(47, True), (48, False)])
def test_a_request_without_new_tokens_reserves_nothing_for_them(
    tokenizer: Tokenizer, prompt: int, fits: bool
) -> None:
    """Room 55 - 0.5 * 16 = 47; a score/embedding request (max_new_tokens 0) needs its prompt."""
    sched = make(tokenizer, pool=64, radix=False, init_new_token_ratio=0.5, min_new_token_ratio=0.5)
    add(sched, req("runner", 8, max_new_tokens=17))
    step(sched)
    late = req("late", prompt, max_new_tokens=0, start=100)
    add(sched, late)
    batch = sched.schedule()
    assert batch is not None and ("late" in [r.rid for r in batch.reqs]) == fits


@pytest.mark.parametrize(("prompt", "fits"), [(43, True), (44, False)])
def test_the_reserve_counts_new_tokens_only_up_to_the_context_length(
    tokenizer: Tokenizer, prompt: int, fits: bool
) -> None:
    """As the exact-boundary test, with max_new_tokens 500 cut by a context of 52 to 9."""
    sched = make(
        tokenizer,
        pool=64,
        radix=False,
        context=52,
        init_new_token_ratio=0.5,
        min_new_token_ratio=0.5,
    )
    add(sched, req("runner", 8, max_new_tokens=16))
    step(sched)
    late = req("late", prompt, max_new_tokens=500, start=100)
    add(sched, late)
    batch = sched.schedule()
    assert batch is not None and ("late" in [r.rid for r in batch.reqs]) == fits


# -- retraction bookkeeping ---------------------------------------------------------------------


def test_retraction_counts_add_up_and_the_step_neither_decays_the_ratio_nor_admits(
    tokenizer: Tokenizer,
) -> None:
    sched = make(
        tokenizer,
        pool=80,
        radix=False,
        init_new_token_ratio=0.5,
        min_new_token_ratio=0.1,
        new_token_ratio_decay_steps=4,
    )
    old, new = req("old", 10, max_new_tokens=60), req("new", 10, max_new_tokens=60, start=60)
    add(sched, old, new)
    step(sched)
    while not sched.stats.retractions:
        step(sched)
    # After the retraction: (decoded + 20) / (60 + 1) for old alone (old has one token more
    # now), not decayed in that step.
    expected = max((len(old.output_ids) - 1 + 20) / 61, 0.5)
    assert 0.5 < expected < 1.0
    assert sched.new_token_ratio == pytest.approx(expected)
    step(sched)
    assert sched.new_token_ratio == pytest.approx(expected - 0.1)
    run_to_idle(sched)
    # The counters add up, per request and in total.
    a, b = req("a", 4, max_new_tokens=20), req("b", 4, max_new_tokens=20, start=50)
    add(sched, a, b)
    step(sched)
    sched._retract(b)
    step(sched)
    step(sched)
    assert b.state != ReqState.WAITING
    sched._retract(b)
    assert b.num_retractions == 2 and sched.stats.retractions == 3


# -- overlap: pending tokens in the bookkeeping ---------------------------------------------------


def test_pending_rows_follow_the_sampling_rows_in_batch_order(tokenizer: Tokenizer) -> None:
    spec = FakeSpeculator(2, [21, 22])
    sched = make(tokenizer, chunk=12, speculator=spec)
    a, b = req("a", 1, max_new_tokens=20), req("plain", 1, start=40)
    c, d = req("c", 8, start=80), req("d", 3, start=200, max_new_tokens=1)
    add(sched, a, b)
    step(sched)
    add(sched, c, d)
    batch = sched.schedule(allow_retract=False)
    # plain decodes (1), a verifies (1 + 2), c's 8 use up the budget (12 - 2 - 2).
    assert shape(batch) == (["plain", "a", "c"], [1, 3, 8], 1) and batch is not None
    tokens = sampled_for(sched, batch)  # (the rows that sample are known before advance)
    sched.advance(batch)
    rows = [(r.pending_row, r.num_pending) for r in (b, a, c)]
    assert rows == [(0, 1), (1, 1), (2, 1)] and c.state == ReqState.DECODE
    sched.commit(batch, tokens)
    run_to_idle(sched)
    # A one-token chunk that is not a prompt's last sorts with the decodes, before a prompt
    # that ends in this step: the rows skip it.
    sched = make(tokenizer, chunk=5)
    a = req("a", 1, max_new_tokens=20)
    add(sched, a)
    step(sched)
    x, c = req("x", 3, start=200), req("c", 30, start=80)
    add(sched, x, c)
    batch = sched.schedule(allow_retract=False)
    assert shape(batch) == (["a", "c", "x"], [1, 1, 3], 2) and batch is not None
    sched.advance(batch)
    assert [(r.pending_row, r.num_pending) for r in (a, x)] == [(0, 1), (1, 1)]
    assert c.num_pending == 0 and c.kv_len == 1
    changed = sched.commit(batch, {0: (TOKEN, None, None), 2: (TOKEN, None, None)})
    assert changed == [a, x] and len(x.output_ids) == 1
    # Plain decodes: rows 0, 1, 2.
    sched = make(tokenizer)
    trio = [req(f"d{i}", 3, max_new_tokens=5, start=30 * i) for i in range(3)]
    add(sched, *trio)
    step(sched)
    batch = sched.schedule(allow_retract=False)
    assert batch is not None and batch.num_decode == 3
    sched.advance(batch)
    assert [r.pending_row for r in trio] == [0, 1, 2]


def test_a_request_at_its_limits_with_a_pending_token_gets_no_step_and_stalls_nothing(
    tokenizer: Tokenizer,
) -> None:
    for max_new, context in ((2, 128), (100, 7)):
        sched = make(tokenizer, context=context)
        r = req("r", 5, max_new_tokens=max_new)
        add(sched, r)
        for _ in range(2):
            batch = sched.schedule(allow_retract=False)
            assert batch is not None
            sched.advance(batch)
        assert sched.schedule(allow_retract=False) is None  # nothing to run, nothing raised
    sched = make(tokenizer)
    emb = req("emb", 5, max_new_tokens=0)
    add(sched, emb)
    batch = sched.schedule(allow_retract=False)
    assert batch is not None
    sched.advance(batch)
    assert emb.num_pending == 0 and emb.kv_len == emb.seq_len
    assert sched.schedule(allow_retract=False) is None
    one = req("one", 5, max_new_tokens=1)
    sched = make(tokenizer)
    add(sched, one)
    batch = sched.schedule(allow_retract=False)
    assert batch is not None
    sched.advance(batch)
    assert one.num_pending == 1 and one.state == ReqState.DECODE and one.pending_row == 0


# -- speculation details --------------------------------------------------------------------------


class RecordingSpeculator(FakeSpeculator):
    def __init__(self, k: int, draft: Sequence[int]) -> None:
        super().__init__(k, draft)
        self.sizes: list[int] = []
        self.proposed: list[list[str]] = []

    def draft_length(self, batch_size: int) -> int:
        self.sizes.append(batch_size)
        return self.k

    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[Draft]:
        self.proposed.append([r.rid for r in reqs])
        return super().propose(reqs, limits)


def test_drafting_asks_by_batch_size_skips_who_cannot_draft_and_slots_every_position(
    tokenizer: Tokenizer,
) -> None:
    spec = RecordingSpeculator(3, [21, 22, 23])
    sched = make(tokenizer, speculator=spec, running=8)
    plain = req("plain", 4, max_new_tokens=20)  # the speculator does not want it
    one_left = req("one", 4, max_new_tokens=2, start=30)  # 1 token left after this: no draft
    two_left = req("two", 4, max_new_tokens=3, start=60)  # one draft
    scored = req("scored", 4, max_new_tokens=20, start=90)
    scored.logprob_start_len = 0  # prompt logprobs: never drafts
    r = req("r", 4, max_new_tokens=20, start=120)
    add(sched, plain, one_left, two_left, scored, r)
    step(sched)
    batch = sched.schedule()
    assert batch is not None
    assert spec.sizes == [5] and spec.proposed == [["two", "r"]] and spec.limits == [[1, 3]]
    idx = batch.reqs.index(r)
    assert r.req_pool_idx is not None
    slots = sched.req_to_token.table[r.req_pool_idx, 4:8].tolist()  # last token + 3 drafts
    assert 0 not in slots and len(set(slots)) == 4 and batch.extend_lens[idx] == 4
    sched.process_output(batch, sampled_for(sched, batch))
    run_to_idle(sched)
    sched.check_no_leak()


def test_a_verify_stops_committing_at_a_stop_or_a_jump_forward(tokenizer: Tokenizer) -> None:
    spec = FakeSpeculator(3, [21, 22, 23])
    sched = make(tokenizer, speculator=spec, grammar=FakeStepper([61, 62]))
    stop = req("stop", 4, max_new_tokens=20, stop_token_ids=[8])
    jump = req("jump", 4, max_new_tokens=20, start=50)
    jump.grammar = object()
    add(sched, stop, jump)
    step(sched)
    batch = sched.schedule()
    assert batch is not None and batch.extend_lens == [4, 4]
    sampled = {
        0: [(21, None, None), (8, None, None), (23, None, None), (30, None, None)],
        1: [(42, None, None), (22, None, None), (23, None, None), (30, None, None)],
    }
    sched.process_output(batch, sampled)
    assert stop.output_ids == [TOKEN, 21, 8] and stop.finished
    assert jump.output_ids == [TOKEN, 42, 61, 62] and jump.state == ReqState.PREFILL
    assert jump.kv_len == 5  # its last token's KV; 42 and the forced tokens come next step
    check_accounting(sched)
    run_to_idle(sched)
    sched.check_no_leak()


def test_sampled_logprobs_reach_the_request(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    r = req("r", 4, max_new_tokens=1, logprobs=True, top_logprobs_num=1)
    add(sched, r)
    batch = sched.schedule()
    assert batch is not None
    sched.process_output(batch, {0: (TOKEN, -0.25, [(-0.25, TOKEN)])})
    assert r.output_logprobs == [-0.25] and r.output_top_logprobs == [[(-0.25, TOKEN)]]


def test_trace_steps_is_off_unless_asked(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    add(sched, req("r", 4))
    run_to_idle(sched)
    assert sched.stats.step_trace == [] and sched.stats.steps == 4


def test_the_default_grammar_stepper_names_a_rejected_token_and_never_jumps(
    tokenizer: Tokenizer,
) -> None:
    from radixserve.core.interfaces import Grammar

    class Rejecting(Grammar):
        def accept_token(self, token_id: int) -> bool:
            return token_id != 99

        def fill_bitmask(self, bitmask: Any, index: int) -> None:
            pass

        def is_terminated(self) -> bool:
            return False

        def rollback(self, num_tokens: int) -> None:
            pass

        def forced_string(self) -> str:
            return "Hello world"

        def copy(self) -> Grammar:
            return Rejecting()

    sched = make(tokenizer)
    r = req("r", 4, max_new_tokens=10)
    r.grammar = Rejecting()
    add(sched, r)
    step(sched)
    assert r.output_ids == [TOKEN] and r.state == ReqState.DECODE  # no jump-forward
    step(sched, token=99)
    assert r.finish_reason is not None and r.finish_reason.type == "abort"
    assert "rejected sampled token 99" in (r.finish_reason.message or "")
    assert repr(tokenizer.decode([99], skip_special_tokens=False)) in (
        r.finish_reason.message or ""
    )


# -- tests added after run 4c's survivors ---------------------------------------------------------


def test_a_generation_prompt_never_waits_for_an_embedding_prefill(tokenizer: Tokenizer) -> None:
    """An embedding's KV never reaches the cache, so waiting for its prefill would gain nothing:
    in its third chunk, the same prompt for generation is admitted beside it."""
    sched = make(tokenizer, chunk=16)
    emb, gen = req("emb", 40, max_new_tokens=0), req("gen", 40)
    emb.pooling = "last"
    add(sched, emb, gen)
    step(sched)
    step(sched)
    batch = step(sched)
    assert shape(batch) == (["emb", "gen"], [8, 8], 0)
    assert sched.stats.deferred_admissions == 0


@pytest.mark.parametrize(("second", "fits"), [(27, True), (28, False)])
def test_each_admitted_request_adds_its_reserve_for_the_next_one(
    tokenizer: Tokenizer, second: int, fits: bool
) -> None:
    """Ratio 0.5. Beside the runner (reserve 0.5 * 15), A (10 tokens, 10 new) is admitted: 45
    free, reserve 7.5 + 0.5 * 10 = 12.5, room 32.5 for B: 27 + 5 fits, 28 + 5 does not."""
    sched = make(tokenizer, pool=64, radix=False, init_new_token_ratio=0.5, min_new_token_ratio=0.5)
    add(sched, req("runner", 8, max_new_tokens=16))
    step(sched)
    a = req("a", 10, max_new_tokens=10, start=100)
    b = req("b", second, max_new_tokens=10, start=200)
    add(sched, a, b)
    batch = sched.schedule()
    assert batch is not None and [r.rid for r in batch.reqs][:2] == ["runner", "a"]
    assert ("b" in [r.rid for r in batch.reqs]) == fits


@pytest.mark.parametrize(("prompt", "fits"), [(13, True), (14, False)])
def test_a_pending_decode_not_in_this_step_reserves_its_unslotted_token(
    tokenizer: Tokenizer, prompt: int, fits: bool
) -> None:
    """Ratio 0. a's last token is pending and gets no step: the slot its KV will need is
    reserved. 20 slots, a holds 6 and will need 1 more: a 13-token prompt fits, 14 does not."""
    sched = make(tokenizer, pool=20, radix=False, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    a = req("a", 5, max_new_tokens=2)
    add(sched, a)
    for _ in range(2):
        batch = sched.schedule(allow_retract=False)
        assert batch is not None
        sched.advance(batch)
    assert (a.seq_len, a.kv_len, sched.allocator.available()) == (7, 6, 14)
    late = req("late", prompt, start=100)
    add(sched, late)
    batch = sched.schedule(allow_retract=False)
    assert (batch is not None) == fits
    assert (late.state == ReqState.PREFILL) == fits


def test_paged_chunks_continue_inside_the_last_page(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, page=4, chunk=6)
    r = req("r", 20, max_new_tokens=2)
    add(sched, r)
    lens = []
    while r.state != ReqState.DECODE:
        batch = step(sched)
        assert batch is not None
        lens.append(batch.extend_lens[0])
        assert r.req_pool_idx is not None
        slots = sched.req_to_token.table[r.req_pool_idx, : r.kv_len]
        pos = torch.arange(r.kv_len)
        assert torch.equal(slots, slots[pos - pos % 4] + pos % 4), slots.tolist()  # whole pages
    assert lens == [6, 6, 6, 2]
    run_to_idle(sched)
    sched.check_no_leak()


def test_a_request_without_room_for_drafts_does_not_stop_the_others_drafting(
    tokenizer: Tokenizer,
) -> None:
    """Pages of 4, no free page: b's drafts (positions 7, 8) need a new page and are skipped;
    a's (6, 7) fit in the page its decode writes into, so a still drafts."""
    spec = RecordingSpeculator(2, [21, 22])
    sched = make(tokenizer, page=4, pool=64, speculator=spec, radix=False)
    b, a = req("b", 6, max_new_tokens=20), req("a", 5, max_new_tokens=20, start=50)
    add(sched, b, a)
    step(sched)
    stolen = sched.allocator.alloc(sched.allocator.available())
    assert stolen is not None
    batch = sched.schedule()
    assert batch is not None and spec.proposed == [["a"]]
    assert shape(batch) == (["b", "a"], [1, 3], 1)
    sched.process_output(batch, sampled_for(sched, batch))
    sched.allocator.free(stolen)
    check_accounting(sched)


def test_a_retracted_request_compares_its_outputs_too_when_waiting_for_a_prefill(
    tokenizer: Tokenizer,
) -> None:
    """A retracted request comes back with prompt + outputs to prefill; the span it compares
    with a running prefill reaches into its outputs."""
    sched = make(tokenizer, chunk=64)
    prompt, outputs = list(range(10, 20)), list(range(100, 130))
    running = Req("running", prompt + outputs + [7, 7], params())
    back = Req("back", list(prompt), params(max_new_tokens=40))
    back.output_ids = list(outputs)  # as after a retraction
    add(sched, running, back)
    step(sched)
    assert sched.stats.deferred_admissions == 1 and back.state == ReqState.WAITING


@pytest.mark.parametrize(("shrink", "prefill"), [(0, 8), (1, 3), (2, 6), (4, 8)])
def test_prefill_tokens_shrink_past_the_decode_threshold(
    tokenizer: Tokenizer, shrink: int, prefill: int
) -> None:
    """chunk 12 beside 4 decodes: 12 - 4 = 8 prefill tokens, or 12 * shrink // 4 once there
    are more decodes than ``shrink`` (0: never)."""
    sched = make(tokenizer, chunk=12, running=8, prefill_shrink_after_decodes=shrink)
    decoders = [req(f"d{i}", 1, max_new_tokens=10, start=30 * i) for i in range(4)]
    long = req("long", 40, start=300)
    add(sched, *decoders, long)
    step(sched)
    before = long.kv_len
    batch = step(sched)
    assert batch is not None and batch.num_decode == 4
    assert long.kv_len - before == prefill


def test_a_token_received_from_a_prefill_server_goes_through_grammar_and_stops(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, grammar=FakeStepper([61, 62]))
    r = req("r", 5, max_new_tokens=10, logprobs=True)
    r.grammar = object()
    sched.append_received(r, 42, -0.5, [(-0.5, 42)])
    assert r.output_ids == [42, 61, 62] and r.state == ReqState.PREFILL
    assert r.output_logprobs[0] == -0.5 and r.output_top_logprobs[0] == [(-0.5, 42)]
    stopped = req("s", 5, stop_token_ids=[8])
    sched.append_received(stopped, 8, None, None)
    assert stopped.finish_reason == FinishReason("stop", matched=8)
    rejected = req("x", 5)
    rejected.grammar = object()
    sched.append_received(rejected, 99, None, None)
    assert rejected.output_ids == [] and rejected.finish_reason == FinishReason(
        "abort", message="rejected"
    )


def test_without_mixed_chunks_prefill_steps_run_alone_and_decodes_wait(
    tokenizer: Tokenizer,
) -> None:
    sched = make(
        tokenizer,
        chunk=8,
        running=8,
        mixed_chunk=False,
        init_new_token_ratio=0.5,
        min_new_token_ratio=0.1,
        new_token_ratio_decay_steps=40,
    )
    sched.trace_steps = True
    a, b = req("a", 3, max_new_tokens=10), req("b", 20, start=100)
    add(sched, a)
    assert shape(step(sched)) == (["a"], [3], 0)
    assert shape(step(sched)) == (["a"], [1], 1)  # nothing to prefill: the decodes run
    add(sched, b)
    assert shape(step(sched)) == (["b"], [8], 0)  # a waits
    assert shape(step(sched)) == (["b"], [8], 0)
    assert shape(step(sched)) == (["b"], [4], 0)
    assert b.state == ReqState.DECODE and len(a.output_ids) == 2
    assert shape(step(sched)) == (["a", "b"], [1, 1], 2)
    assert sched.stats.step_trace == [(0, 3), (1, 0), (0, 8), (0, 8), (0, 4), (2, 0)]
    assert sched.new_token_ratio == pytest.approx(0.5 - 6 * 0.01)  # every step decays
    # One-token prompts sort as decodes; a paused scheduler admits nothing and decodes.
    add(sched, req("d", 5, start=300), req("c", 1, start=200))
    assert shape(step(sched)) == (["c", "d"], [1, 5], 1)
    sched.paused = True
    add(sched, req("e", 5, start=400))
    assert shape(step(sched)) == (["a", "b", "d", "c"], [1, 1, 1, 1], 4)  # running order
    assert [r.rid for r in sched.waiting] == ["e"]


def test_without_mixed_chunks_a_running_prefill_and_an_admission_share_the_budget(
    tokenizer: Tokenizer,
) -> None:
    # The running prefill takes 7 of the 8-token budget first; the admission gets the last
    # token, and both chunks run in one step.
    sched = make(tokenizer, chunk=8, running=8, mixed_chunk=False)
    b, c = req("b", 15, start=100), req("c", 5, start=200)
    add(sched, b)
    assert shape(step(sched)) == (["b"], [8], 0)
    add(sched, c)
    assert shape(step(sched)) == (["c", "b"], [1, 7], 1)
    assert shape(step(sched)) == (["c"], [4], 0)  # b decodes in the next mixed-free step


# -- steps by kind, and admission gathering arrivals (--prefill-gather-steps) ---------------


def test_step_kind_names_decode_only_mixed_and_prefill_only_steps() -> None:
    assert step_kind(3, 0) == "decode"
    assert step_kind(0, 5) == "prefill"
    assert step_kind(2, 5) == "mixed"
    # a kind's wall time is reported to the microsecond
    assert StepKindStats(seconds=1.23456789).to_json()["seconds"] == 1.234568


def test_steps_are_counted_by_kind_with_their_decodes_and_prefill_tokens(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, chunk=8)
    a, b = req("a", 5, max_new_tokens=10), req("b", 20, start=100)
    add(sched, a)
    kinds = [step(sched)]
    add(sched, b)
    kinds += [step(sched) for _ in range(4)]
    assert [k.kind for k in kinds if k] == ["prefill", "mixed", "mixed", "mixed", "decode"]
    by_kind = {k: v.to_json() for k, v in sched.stats.by_kind.items()}
    assert by_kind == {
        "prefill": {"steps": 1, "decodes": 0, "prefill_tokens": 5, "seconds": 0.0},
        "mixed": {"steps": 3, "decodes": 3, "prefill_tokens": 20, "seconds": 0.0},
        "decode": {"steps": 1, "decodes": 2, "prefill_tokens": 0, "seconds": 0.0},
    }
    # without mixed chunks, a step of prefill chunks alone is counted as prefill
    alone = make(tokenizer, chunk=8, mixed_chunk=False)
    add(alone, req("c", 3, max_new_tokens=10))
    step(alone)
    add(alone, req("d", 6, start=100))
    batch = step(alone)
    assert batch is not None and batch.kind == "prefill"
    assert alone.stats.by_kind["prefill"].steps == 2
    assert alone.stats.by_kind["prefill"].prefill_tokens == 9


def held_steps(sched: Scheduler, r: Req) -> int:
    """Add ``r`` and step until it is admitted; return how many steps it waited."""
    add(sched, r)
    for n in range(10):
        step(sched)
        if r.state != ReqState.WAITING:
            return n
    raise AssertionError(f"{r.rid} was never admitted")


def gathering(tokenizer: Tokenizer, steps: int, chunk: int = 8, **config: Any) -> Scheduler:
    """A scheduler that gathers arrivals for ``steps`` steps, with one request decoding."""
    config.setdefault("prefill_gather_max_wait_s", 10.0)  # never reached unless a test says
    sched = make(tokenizer, chunk=chunk, running=8, prefill_gather_steps=steps, **config)
    a = req("a", 3, max_new_tokens=100)
    assert held_steps(sched, a) == 0  # nothing decodes: the first admission is not held
    return sched


def test_by_default_admission_never_waits_and_a_wait_ends_after_50_ms(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer, chunk=8, running=8)
    add(sched, req("a", 3, max_new_tokens=100))
    step(sched)
    assert held_steps(sched, req("b", 2, start=100)) == 0
    late_sched = make(tokenizer, chunk=8, running=8, prefill_gather_steps=3)
    add(late_sched, req("a", 3, max_new_tokens=100))
    step(late_sched)
    late = req("late", 2, start=100)
    late.arrival_time -= 0.06  # arrived 60 ms ago: past the default bound
    assert held_steps(late_sched, late) == 0


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_while_decodes_run_a_small_arrival_waits_the_gather_steps(
    tokenizer: Tokenizer, steps: int
) -> None:
    sched = gathering(tokenizer, steps)
    assert held_steps(sched, req("b", 2, start=100)) == steps
    assert sched.stats.by_kind["decode"].steps == steps  # the held steps decode alone
    assert held_steps(sched, req("c", 2, start=200)) == steps  # the count starts again
    assert sched.stats.gathering_steps == 2 * steps


def test_arrivals_during_the_wait_are_admitted_together(tokenizer: Tokenizer) -> None:
    sched = gathering(tokenizer, 2)
    add(sched, req("b", 2, start=100))
    assert shape(step(sched)) == (["a"], [1], 1)
    add(sched, req("c", 2, start=200))
    assert shape(step(sched)) == (["a"], [1], 1)
    assert shape(step(sched)) == (["a", "b", "c"], [1, 2, 2], 1)


@pytest.mark.parametrize(
    ("prompts", "held"), [((6,), True), ((7,), False), ((3, 3), True), ((3, 4), False)]
)
def test_waiting_prompts_that_fill_the_prefill_budget_are_admitted_at_once(
    tokenizer: Tokenizer, prompts: tuple[int, ...], held: bool
) -> None:
    sched = gathering(tokenizer, 3)  # chunk 8 beside one decode: 7 prefill tokens
    waiting = [req(f"w{i}", n, start=100 * (i + 1)) for i, n in enumerate(prompts)]
    add(sched, *waiting)
    step(sched)
    assert [r.state == ReqState.WAITING for r in waiting] == [held] * len(waiting)


@pytest.mark.parametrize(("ages", "held"), [((0.0, 9.0), True), ((0.0, 11.0), False)])
def test_admission_waits_no_longer_than_the_oldest_arrival_allows(
    tokenizer: Tokenizer, ages: tuple[float, ...], held: bool
) -> None:
    sched = gathering(tokenizer, 3)  # at most 10 s after the oldest waiting arrival
    waiting = [req(f"w{i}", 2, start=100 * (i + 1)) for i in range(len(ages))]
    for r, age in zip(waiting, ages, strict=True):
        r.arrival_time -= age
    add(sched, *waiting)
    step(sched)
    assert [r.state == ReqState.WAITING for r in waiting] == [held] * len(waiting)


def test_a_step_that_prefills_anyway_admits_small_arrivals_at_once(
    tokenizer: Tokenizer,
) -> None:
    sched = gathering(tokenizer, 3, chunk=16)
    long = req("long", 20, start=100)
    assert held_steps(sched, long) == 0  # 20 tokens fill the 15-token budget
    assert long.kv_len == 15
    b = req("b", 2, start=200)
    add(sched, b)
    assert shape(step(sched)) == (["a", "long", "b"], [1, 5, 2], 1)


# -- step strategies: the fixed points the scheduler calls ------------------------------------


class EchoRows(StepStrategy):
    """Gives every decode two extra rows (tokens 21, 22) with slots it allocates through the
    scheduler, and records what the scheduler reports back."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, int, int]] = []
        self.gone: list[str] = []

    def extend_plan(self, scheduler: Any, decodes: list[Any]) -> dict[str, Any]:
        from radixserve.core.interfaces import Draft

        out = {}
        for r in decodes:
            if not r.num_pending and scheduler.alloc_positions(r, r.kv_len + 1, 2):
                out[r.rid] = Draft([21, 22])
        return out

    def committed(self, plan: Any, outcomes: list[tuple[Any, Any, int, int]]) -> None:
        self.outcomes += [(r.rid, emitted, kept) for r, _, emitted, kept in outcomes]

    def released(self, req: Any) -> None:
        self.gone.append(req.rid)


def test_a_strategy_extends_decodes_and_the_commit_keeps_only_the_kept_positions(
    tokenizer: Tokenizer,
) -> None:
    """Any strategy (not only speculation) may give decodes extra rows: the plan extends them
    over their last token and the rows, the entry samples a list, and the commit keeps the KV
    of exactly the positions the kept tokens follow, frees the rest, and reports each outcome."""
    strategy = EchoRows()
    sched = make(tokenizer, pool=64)
    sched.strategies.append(strategy)
    r = req("r", 6, max_new_tokens=10)
    add(sched, r)
    step(sched)  # the prefill: position 0..5, one token out
    plan = sched.schedule()
    assert plan is not None and plan.extend_lens == [3] and list(plan.extra) == [0]
    assert sched.needs_sampling(plan) == [0]
    free = sched.allocator.available()
    changed = sched.process_output(plan, {0: [(21, None, None), (40, None, None)]})
    assert changed == [r] and r.output_ids == [TOKEN, 21, 40]
    assert r.kv_len == 8 and r.num_pending == 0  # positions 6 (last token) and 7 (kept row)
    assert sched.allocator.available() == free + 1  # position 8's slot went back
    assert strategy.outcomes == [("r", 2, 2)]
    check_accounting(sched)
    run_to_idle(sched)
    assert r.finished and strategy.gone == ["r"]
    sched.check_no_leak()
