"""The device loop's host side (core/spec_loop.py) without a model: a scripted ``DeviceCycle``
emits the tokens the test chooses, on a real Scheduler (allocator, slot table, radix cache, stop
checker) and a real Speculator. Checked exactly: which requests the loop takes and when it must
stop, the KV slots it holds ahead (allocated, freed at a finish, a stop or a failure), the
tokens each committed cycle appends (cut by a stop or the token budget), what it reports to the
speculation policy, and the target's verify forward (``DeviceVerify``) on device rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hand_scheduler import hand_scheduler

from radixserve.core.batch import ForwardBatch
from radixserve.core.interfaces import DeviceCycle, Draft, SpeculativeAlgorithm
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.request import Req, ReqState, SamplingParams
from radixserve.core.scheduler import Scheduler
from radixserve.core.spec_adaptive import AdaptiveDrafting
from radixserve.core.spec_loop import DeviceVerify, SpecLoop, loops_greedily
from radixserve.core.speculative import Speculator
from radixserve.core.tokenizer import Tokenizer

EOS = 0
FIRST = 7  # the token every prefill samples
K = 2  # drafts a cycle: q = 3 positions a cycle
Q = K + 1
PROMPT = 4  # prompt tokens: kv_len 4 after the prefill


class Nothing(SpeculativeAlgorithm):
    def __init__(self) -> None:
        self.verified_calls: list[tuple[list[str], list[int]]] = []

    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        return [Draft([]) for _ in reqs]

    def verified(self, reqs: Sequence[Any], accepted: Sequence[int]) -> None:
        self.verified_calls.append(([r.rid for r in reqs], list(accepted)))


class Recording(Speculator):
    """The real Speculator, its step timings and verify counts recorded as the loop gives
    them."""

    def __init__(self, disable_batch_size: int = 32, **kw: Any) -> None:
        kw.setdefault("pause_unprofitable", False)
        super().__init__(Nothing(), "nothing", K, disable_batch_size, vocab_size=362, **kw)
        self.steps: list[tuple[bool, int, float, int]] = []
        self.verifies: list[tuple[list[str], list[int], list[int], int, bool]] = []

    def observe_step(self, verify: bool, batch_size: int, seconds: float, **kw: Any) -> None:
        self.steps.append((verify, batch_size, seconds, kw.get("draft_rows", -1)))
        super().observe_step(verify, batch_size, seconds, **kw)

    def verified(self, reqs: Any, drafted: Any, accepted: Any, batch_size: int, **kw: Any) -> None:
        self.verifies.append(
            ([r.rid for r in reqs], list(drafted), list(accepted), batch_size, kw["judge"])
        )
        super().verified(reqs, drafted, accepted, batch_size, **kw)


class Scripted(DeviceCycle):
    """Emits the rows the test queued, one list (per request: t0..tk, then a) a cycle. Like a
    captured cycle it reads the slot table's device mirror, which only ``sync`` brings up to
    date: at each launch it records each request's slots for its next 2q positions."""

    def __init__(self, sched: Scheduler, max_batch: int = 4) -> None:
        self.k, self.max_batch = K, max_batch
        self.sched = sched
        self.mirror = sched.req_to_token.device_table("cpu")
        self.queue: list[list[list[int]]] = []
        self.begun: list[list[str]] = []
        self.ended: list[tuple[list[str], list[int]]] = []
        self.seen_slots: list[list[list[int]]] = []
        self.reqs: list[Req] = []

    def begin(self, reqs: Sequence[Any]) -> None:
        self.reqs = list(reqs)
        self.begun.append([r.rid for r in reqs])

    def launch(self) -> Callable[[], list[list[int]]]:
        self.seen_slots.append(
            [self.mirror[r.req_pool_idx, r.kv_len : r.kv_len + 2 * Q].tolist() for r in self.reqs]
        )
        rows = self.queue.pop(0)
        return lambda: rows

    def end(self, reqs: Sequence[Any], trusted: Sequence[int]) -> None:
        self.ended.append(([r.rid for r in reqs], list(trusted)))


def make(tokenizer: Tokenizer, pool: int = 256, context: int = 64, running: int = 4) -> Scheduler:
    return hand_scheduler(tokenizer, EOS, pool=pool, context=context, running=running)


def greedy(max_new_tokens: int = 40, **kw: Any) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


def decoding(sched: Scheduler, *reqs: Req) -> list[Req]:
    """``reqs`` prefilled (each samples FIRST): decoding, their last token on the host."""
    for r in reqs:
        sched.add_request(r)
    plan = sched.schedule()
    assert plan is not None
    sched.process_output(plan, {i: (FIRST, None, None) for i in sched.needs_sampling(plan)})
    assert all(r.state == ReqState.DECODE and r.kv_len == len(r.input_ids) for r in reqs)
    return list(reqs)


def prompt(rid: str, n: int = PROMPT, start: int = 10, **kw: Any) -> Req:
    return Req(rid, list(range(start, start + n)), greedy(**kw))


def check_accounting(sched: Scheduler, ahead: int = 0) -> None:
    """Every slot is free, in the tree, or held by a running request past its prefix (plus
    ``ahead`` slots the loop holds past the requests' ends)."""
    acct = sched.kv_accounting()
    held = sum(r.kv_len - r.prefix_len for r in sched.running)
    assert acct["in_use"] == held + ahead, (acct, sched.running)
    assert acct["free"] + acct["evictable"] + acct["locked"] + acct["in_use"] == acct["size"]


def table_row(sched: Scheduler, req: Req, start: int, end: int) -> list[int]:
    assert req.req_pool_idx is not None
    return sched.req_to_token.table[req.req_pool_idx, start:end].tolist()


# -- which requests loop -------------------------------------------------------------------------


def test_a_request_loops_greedily_only_with_nothing_for_the_host_between_tokens() -> None:
    def req(state: ReqState = ReqState.DECODE, out: int = 1, **kw: Any) -> Req:
        r = Req("r", [1, 2, 3], greedy(**kw))
        r.state, r.output_ids = state, [FIRST] * out
        return r

    assert loops_greedily(req())
    assert loops_greedily(req(min_new_tokens=1))  # its last masked token is out
    assert not loops_greedily(req(min_new_tokens=2))
    assert not loops_greedily(req(ReqState.PREFILL))
    assert not loops_greedily(req(temperature=0.7))
    assert not loops_greedily(req(logprobs=True))
    assert not loops_greedily(req(logit_bias={"5": 1.0}))
    pending = req()
    pending.num_pending = 1
    assert not loops_greedily(pending)
    scoring = req()
    scoring.label_token_ids = []
    assert not loops_greedily(scoring)


def test_the_loop_takes_every_running_request_while_each_fits(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    spec = Recording()
    cycle = Scripted(sched, max_batch=2)
    loop = SpecLoop(cycle, sched, spec, max_context=64)
    assert loop.eligible() is None  # nothing runs
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    taken = loop.eligible()
    assert taken == [a, b] and taken is not sched.running
    sched.waiting.append(prompt("w"))
    assert loop.eligible() is None  # an arrival goes first
    sched.waiting.clear()
    sched.paused = True
    assert loop.eligible() is None
    sched.paused = False
    cycle.max_batch = 1
    assert loop.eligible() is None  # more requests than a cycle takes
    cycle.max_batch, cycle.k = 2, K + 1
    assert loop.eligible() is None  # the policy drafts fewer than a cycle's k
    cycle.k = K
    spec.pause([b], 2, probe=True)
    assert loop.eligible() is None  # a paused request holds the loop off
    assert not spec.wants(b) and not spec.wants(b)
    assert loop.eligible() == [a, b]
    b.state = ReqState.PREFILL  # (a grammar's jump-forward)
    assert loop.eligible() is None


def test_the_policy_drafting_fewer_tokens_at_this_batch_size_keeps_the_loop_off(
    tokenizer: Tokenizer,
) -> None:
    sched = make(tokenizer)
    decoding(sched, prompt("a"), prompt("b", start=30))
    one = Recording(disable_batch_size=1)  # two decodes: no drafting at all
    assert SpecLoop(Scripted(sched), sched, one, max_context=64).eligible() is None
    assert SpecLoop(Scripted(sched), sched, Recording(), max_context=64).eligible() is not None


def test_a_request_fits_with_room_for_two_cycles_and_tokens_left_to_emit(
    tokenizer: Tokenizer,
) -> None:
    """kv_len >= q (the cycle's catch-up reads q positions back); seq_len + 2q + 1 below the
    context; an output token still to emit."""
    sched = make(tokenizer)
    (short,) = decoding(sched, prompt("short", n=Q - 1))
    loop = SpecLoop(Scripted(sched), sched, Recording(), max_context=64)
    assert loop.eligible() is None
    sched = make(tokenizer)
    (r,) = decoding(sched, prompt("r", n=Q, max_new_tokens=2))
    seq = Q + 1
    assert SpecLoop(Scripted(sched), sched, Recording(), seq + 2 * Q + 2).eligible() == [r]
    assert SpecLoop(Scripted(sched), sched, Recording(), seq + 2 * Q + 1).eligible() is None
    loop = SpecLoop(Scripted(sched), sched, Recording(), max_context=64)
    r.sampling.max_new_tokens = 1  # its one token is out
    assert loop.eligible() is None


def test_the_adaptive_policy_decides_whether_k_drafts_pay(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    (a,) = decoding(sched, prompt("a"))
    adaptive = AdaptiveDrafting(K)
    spec = Recording(adaptive=adaptive)
    loop = SpecLoop(Scripted(sched), sched, spec, max_context=64)
    assert loop.eligible() == [a]
    for _ in range(20):  # a that never accepts: k drafts no longer pay
        adaptive.observed("a", K, 0)
    assert not adaptive.pays_at(["a"], 1, K) and loop.eligible() is None


# -- slots ahead, cycles, commits ------------------------------------------------------------------


def test_cycles_commit_one_behind_with_slots_held_ahead(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, pool=128)
    spec = Recording()
    cycle = Scripted(sched)
    loop = SpecLoop(cycle, sched, spec, max_context=64)
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    free = sched.allocator.available()
    loop._deficit = loop._episode = 3.0
    t0 = time.perf_counter()
    assert loop.start([a, b])
    assert loop.active and loop.loops == 1 and cycle.begun == [["a", "b"]]
    assert loop._deficit == 0.0 and loop._episode == 0.0
    assert len(loop._restarts) == 1 and 0 <= loop._restarts[0] <= time.perf_counter() - t0
    # runs of 4q slots from kv_len: positions 4 .. 15 of each
    assert sched.allocator.available() == free - 2 * 4 * Q
    assert loop._slot_end == {"a": PROMPT + 4 * Q, "b": PROMPT + 4 * Q}
    check_accounting(sched, ahead=2 * 4 * Q)

    cycle.queue = [[[31, 32, 33, 2], [41, 42, 43, 0]], [[34, 35, 36, 2], [44, 45, 46, 1]]]
    assert loop.advance() == [] and loop.cycles == 1  # the first cycle is in flight
    # the mirror the cycle reads has every slot ahead (the table was synced before launch)
    assert cycle.seen_slots[0] == [table_row(sched, r, PROMPT, PROMPT + 2 * Q) for r in (a, b)]
    assert all(s > 0 for row in cycle.seen_slots[0] for s in row)
    before = time.perf_counter()
    assert loop.advance() == [a, b] and loop.cycles == 2
    assert a.output_ids == [FIRST, 31, 32, 33] and a.kv_len == PROMPT + 3
    assert b.output_ids == [FIRST, 41] and b.kv_len == PROMPT + 1
    assert loop._trusted == {"a": PROMPT, "b": PROMPT}
    assert spec.verifies == [(["a", "b"], [K, K], [2, 0], 2, False)]
    assert spec.algorithm.verified_calls == [(["a", "b"], [2, 0])]
    assert spec.stats.draft_tokens == 2 * K and spec.stats.accepted_tokens == 2
    ((verify, size, seconds, rows),) = spec.steps
    assert (verify, size, rows) == (True, 2, 2 * K)
    assert 0 <= seconds <= time.perf_counter() - t0 and loop._last_commit_at >= before
    check_accounting(sched, ahead=2 * 4 * Q - 4)

    # a: kv_len 7 + 2q = 13 <= 16, b: 5 + 6 <= 16: no slots needed yet
    cycle.queue.append([[37, 38, 39, 2], [47, 48, 49, 2]])
    assert loop.advance() == [a, b]
    assert a.kv_len == PROMPT + 6 and b.kv_len == PROMPT + 3  # after the second cycle
    assert loop._slot_end == {"a": 16, "b": 16}  # a at 10: 10 + 6 = 16 still has them
    assert loop._trusted == {"a": PROMPT + 3, "b": PROMPT + 1}
    cycle.queue.append([[51, 52, 53, 0], [54, 55, 56, 0]])
    free = sched.allocator.available()
    assert loop.advance() == [a, b]  # launched with a at 10: 10 + 2q = 16, still enough
    assert (a.kv_len, b.kv_len) == (PROMPT + 9, PROMPT + 6)
    assert loop._slot_end == {"a": 16, "b": 16} and sched.allocator.available() == free
    cycle.queue.append([[57, 58, 59, 1], [60, 61, 62, 0]])
    assert loop.advance() == [a, b]  # a at 13 needs up to 19: 13 + 4q - 16 = 9 more
    assert loop._slot_end == {"a": 25, "b": 16}
    assert sched.allocator.available() == free - 9
    assert cycle.seen_slots[-1][0] == table_row(sched, a, 13, 13 + 2 * Q)
    assert (a.kv_len, b.kv_len) == (PROMPT + 10, PROMPT + 7)

    changed = loop.stop()  # the last cycle in flight is committed, the slots ahead go back
    assert changed == [a, b] and not loop.active
    assert a.output_ids[-2:] == [57, 58] and b.output_ids[-1] == 60
    assert (a.kv_len, b.kv_len) == (PROMPT + 12, PROMPT + 8)
    assert cycle.ended == [(["a", "b"], [PROMPT + 10, PROMPT + 7])]
    assert loop._slot_end == {}
    check_accounting(sched)
    assert spec.stats.verify_steps == 5 and len(spec.steps) == 5


def test_a_finish_mid_cycle_keeps_what_came_before_and_frees_its_slots(
    tokenizer: Tokenizer,
) -> None:
    """a's budget ends after 31 (one of its two accepted drafts counted), b stops at its stop
    token 42; the next cycle's tokens of both are dropped and only c goes on."""
    sched = make(tokenizer, pool=128)
    spec = Recording()
    cycle = Scripted(sched)
    loop = SpecLoop(cycle, sched, spec, max_context=64)
    a, b, c = decoding(
        sched,
        prompt("a", max_new_tokens=3),
        prompt("b", start=30, stop_token_ids=[42]),
        prompt("c", start=50),
    )
    free = sched.allocator.available()
    assert loop.start([a, b, c])
    cycle.queue = [
        [[31, 32, 33, 2], [41, 42, 43, 2], [61, 62, 63, 2]],
        [[34, 35, 36, 2], [44, 45, 46, 2], [64, 65, 66, 1]],
    ]
    loop.advance()
    assert sched.allocator.available() == free - 3 * 4 * Q
    assert loop.advance() == [a, b, c]
    assert a.finished and a.output_ids == [FIRST, 31, 32]
    assert b.finished and b.output_ids == [FIRST, 41, 42]
    assert c.output_ids == [FIRST, 61, 62, 63]
    assert a not in sched.running and b not in sched.running and a.req_pool_idx is None
    # kept 1 of 2 accepted: 1 counted drafted and accepted; c accepted all: k drafted
    assert spec.verifies == [(["a", "b", "c"], [1, 1, K], [1, 1, 2], 3, False)]
    assert loop._slot_end == {"c": PROMPT + 4 * Q}
    check_accounting(sched, ahead=4 * Q - 3)
    assert not loop.can_continue()
    assert loop.stop() == [c]  # a's and b's tokens of the cycle in flight are dropped
    assert a.output_ids == [FIRST, 31, 32] and b.output_ids == [FIRST, 41, 42]
    assert c.output_ids == [FIRST, 61, 62, 63, 64, 65]
    assert spec.verifies[-1] == (["c"], [K], [1], 3, False)
    assert cycle.ended == [(["c"], [PROMPT + 3])]
    check_accounting(sched)


def test_the_adaptive_policy_sees_each_requests_verify(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    adaptive, expected = AdaptiveDrafting(K), AdaptiveDrafting(K)
    spec = Recording(adaptive=adaptive)
    cycle = Scripted(sched)
    loop = SpecLoop(cycle, sched, spec, max_context=64)
    a, b = decoding(sched, prompt("a", max_new_tokens=3), prompt("b", start=30))
    assert loop.start([a, b])
    cycle.queue = [[[31, 32, 33, 2], [41, 42, 43, 0]]]
    loop.advance()
    loop.stop()
    expected.observed("a", 1, 1)
    expected.observed("b", K, 0)
    for rid in ("a", "b"):
        assert (
            adaptive.accept_prob(rid)
            == expected.accept_prob(rid)
            != AdaptiveDrafting(K).accept_prob(rid)
        )


def test_the_loop_goes_on_only_while_its_requests_stay_as_they_were(tokenizer: Tokenizer) -> None:
    def looping() -> tuple[Scheduler, SpecLoop, Recording, list[Req]]:
        sched = make(tokenizer)
        spec = Recording()
        loop = SpecLoop(Scripted(sched), sched, spec, max_context=64)
        reqs = decoding(sched, prompt("a"), prompt("b", start=30))
        assert loop.start(list(reqs)) and loop.can_continue()
        return sched, loop, spec, reqs

    sched, loop, _, _ = looping()
    sched.waiting.append(prompt("w"))
    assert not loop.can_continue()
    sched, loop, _, _ = looping()
    sched.paused = True
    assert not loop.can_continue()
    sched, loop, _, (a, b) = looping()
    sched.abort("b")
    assert not loop.can_continue()
    sched, loop, _, (a, b) = looping()
    sched.running.remove(b)
    sched.running.append(prompt("other"))  # as many running, not the same ones
    assert not loop.can_continue()
    sched, loop, _, (a, b) = looping()
    b.state = ReqState.FINISHED
    assert not loop.can_continue()
    sched, loop, _, (a, b) = looping()
    a.num_pending = 1
    assert not loop.can_continue()
    sched, loop, spec, (a, b) = looping()
    spec.pause([a], 1)
    assert not loop.can_continue()


def test_no_slots_ahead_no_loop(tokenizer: Tokenizer) -> None:
    """a's run of slots fits, b's does not: a's go back and nothing starts."""
    sched = make(tokenizer)
    cycle = Scripted(sched)
    loop = SpecLoop(cycle, sched, Recording(), max_context=64)
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    taken = sched.allocator.alloc(sched.allocator.available() - (4 * Q + 3))
    assert taken is not None
    assert not loop.start([a, b])
    assert not loop.active and cycle.begun == [] and loop.loops == 0
    assert sched.allocator.available() == 4 * Q + 3 and loop._slot_end == {}
    sched.allocator.free(taken)
    check_accounting(sched)


def test_slots_ahead_stop_at_the_context(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer, context=64)
    (a,) = decoding(sched, prompt("a"))
    free = sched.allocator.available()
    loop = SpecLoop(Scripted(sched), sched, Recording(), max_context=PROMPT + 2 * Q + 3)
    assert loop.start([a])
    assert loop._slot_end == {"a": PROMPT + 2 * Q + 3}
    assert sched.allocator.available() == free - (2 * Q + 3)


def test_a_cycle_that_cannot_get_its_slots_drains_the_loop(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    spec = Recording()
    cycle = Scripted(sched)
    loop = SpecLoop(cycle, sched, spec, max_context=64)
    (a,) = decoding(sched, prompt("a"))
    taken = sched.allocator.alloc(sched.allocator.available() - (4 * Q + 1))
    assert taken is not None
    assert loop.start([a])
    cycle.queue = [[[31, 32, 33, 2]], [[34, 35, 36, 2]], [[37, 38, 39, 2]]]
    loop.advance()
    loop.advance()  # launched with a at 4, then a at 7 (7 + 2q <= 16)
    assert a.kv_len == PROMPT + 3
    assert loop.advance() == [a] and a.kv_len == PROMPT + 6  # launched at 7
    cycle.queue.append([[40, 41, 42, 2]])
    assert loop.advance() == [a] and a.kv_len == PROMPT + 9  # launched at 10: 16, enough
    # at 13 the launch wants 9 more slots, the pool has 1: the loop stops, committing its
    # cycle in flight
    assert loop.advance() == [a] and not loop.active
    assert a.output_ids[-3:] == [40, 41, 42] and a.kv_len == PROMPT + 12
    assert loop.cycles == 4 and cycle.ended == [(["a"], [PROMPT + 9])]
    assert sched.allocator.available() == 1  # a's 12 slots ahead all hold its KV now
    sched.allocator.free(taken)
    check_accounting(sched)


def test_abandoning_the_loop_frees_its_slots_and_commits_nothing(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    cycle = Scripted(sched)
    spec = Recording()
    loop = SpecLoop(cycle, sched, spec, max_context=64)
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    free = sched.allocator.available()
    assert loop.start([a, b])
    cycle.queue = [[[31, 32, 33, 2], [41, 42, 43, 2]]]
    loop.advance()
    assert loop.abandon() == [a, b]
    assert not loop.active and loop._slot_end == {} and loop._in_flight is None
    assert a.output_ids == [FIRST] and a.kv_len == PROMPT and spec.verifies == []
    assert cycle.ended == []
    assert sched.allocator.available() == free
    check_accounting(sched)
    assert loop.stop() == [] and cycle.ended == []


# -- the target's verify forward -------------------------------------------------------------


class Attention:
    prepares_verify_on_device = True
    prepares_decode_on_device = True

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], int]] = []

    def prepare_verify_graph(self, rows: torch.Tensor, seq_lens: torch.Tensor, q: int) -> None:
        self.calls.append((rows.tolist(), seq_lens.tolist(), q))


class Model:
    def __init__(self) -> None:
        self.batches: list[ForwardBatch] = []

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.batches.append(batch)
        return batch.input_ids.float()[:, None] * torch.ones(1, 5)


def test_device_verify_runs_the_target_over_q_rows_a_request() -> None:
    table = ReqToTokenPool(4, 32)
    model, attention, consumed = Model(), Attention(), []
    verify = DeviceVerify(model, attention, "KV", table, (1, 3), consumed.append)
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    positions = torch.tensor([4, 5, 6, 8, 9, 10])
    slots = torch.tensor([20, 21, 22, 30, 31, 32])
    rows, lens = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([7, 11])
    logits = verify(ids, positions, slots, rows, lens, 3)
    assert logits[:, 0].tolist() == [5, 6, 7, 8, 9, 10]
    (batch,) = model.batches
    assert attention.calls == [([1, 2], [7, 11], 3)]
    assert batch.input_ids is ids and batch.positions is positions and batch.out_cache_loc is slots
    assert batch.req_pool_indices.tolist() == [table.pad_row] * 2
    assert batch.req_pool_indices.dtype == torch.int64
    assert batch.req_to_token is table.table and batch.req_to_token_pool is table
    assert batch.seq_lens == [3, 3] and batch.extend_lens == [3, 3] and batch.num_decode == 0
    assert batch.logits_indices.tolist() == list(range(6)) and batch.kv_pool == "KV"
    assert batch.capture_hidden_layers == (1, 3) and consumed == [batch]


def test_device_verify_hands_hidden_states_on_only_where_layers_are_kept() -> None:
    table = ReqToTokenPool(4, 32)
    ids = torch.tensor([5, 6])
    args = (ids, torch.tensor([3, 4]), torch.tensor([9, 10]), torch.tensor([0]), torch.tensor([5]))
    consumed: list[ForwardBatch] = []
    DeviceVerify(Model(), Attention(), None, table, (), consumed.append)(*args, 2)
    assert consumed == []
    model = Model()
    DeviceVerify(model, Attention(), None, table, (2,), None)(*args, 2)  # no consumer: fine
    assert len(model.batches) == 1 and model.batches[0].capture_hidden_layers == (2,)


def test_a_fresh_or_stopped_loop_stops_and_abandons_as_a_no_op(tokenizer: Tokenizer) -> None:
    sched = make(tokenizer)
    cycle = Scripted(sched)
    loop = SpecLoop(cycle, sched, Recording(), max_context=64)
    assert not loop.active and loop.stop() == [] and loop.abandon() == []
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    taken = sched.allocator.alloc(sched.allocator.available() - 1)
    assert not loop.start([a, b]) and loop.stop() == [] and cycle.ended == []
    sched.allocator.free(taken)
    assert loop.start([a, b])
    # stopped before its first cycle: the drafter trusts none of its own KV
    assert loop.stop() == [] and cycle.ended == [(["a", "b"], [0, 0])]
    assert loop.stop() == [] and len(cycle.ended) == 1
    assert loop.start([a, b]) and loop.loops == 2
    loop.stop()
    check_accounting(sched)


def test_each_request_gets_its_slots_when_it_needs_them(tokenizer: Tokenizer) -> None:
    """b accepts every draft, a none: b needs slots first, a checked before it."""
    sched = make(tokenizer)
    cycle = Scripted(sched)
    loop = SpecLoop(cycle, sched, Recording(), max_context=64)
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    assert loop.start([a, b])
    cycle.queue = [[[31, 32, 33, 0], [41, 42, 43, 2]] for _ in range(5)]
    for _ in range(5):
        loop.advance()  # launched with b at 4, 7, 10, then 13: 9 more slots at the 5th
    assert (a.kv_len, b.kv_len) == (PROMPT + 4, PROMPT + 12)
    assert loop._slot_end == {"a": 16, "b": 25}
    assert cycle.seen_slots[-1][1] == table_row(sched, b, 13, 19)
    loop.stop()
    check_accounting(sched)


def test_committed_cycles_are_judged_by_the_pause_policy(tokenizer: Tokenizer) -> None:
    """Measured: a decode step of 0.25 s, cycles of 0.375 (a window full of them, which the
    cycles timed here do not move): break-even 1.5 tokens. Cycles gaining 3 pay; then five
    gaining 1 lose 2.5 > MIN_DEFICIT: the loop's requests pause together."""
    sched = make(tokenizer)
    spec = Recording(pause_unprofitable=True)
    spec.observe_step(False, 2, 0.25)
    for _ in range(15):
        spec.observe_step(True, 2, 0.375)
    cycle = Scripted(sched)
    loop = SpecLoop(cycle, sched, spec, max_context=64)
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    assert loop.start([a, b])
    good, poor = [[31, 32, 33, 2], [41, 42, 43, 2]], [[31, 32, 33, 0], [41, 42, 43, 0]]
    cycle.queue = [good, good] + [poor] * 5 + [poor]
    loop.advance()
    for _ in range(6):
        loop.advance()
        assert loop.can_continue() and loop.verdicts == 0
    loop.advance()  # commits the fifth poor cycle
    assert loop.verdicts == 1 and not loop.can_continue()
    assert not spec.may_draft(a) and not spec.may_draft(b)
    loop.stop()
    check_accounting(sched)


def _judged(decode_s: float | None = 0.25, cycle_s: float = 0.375) -> tuple[SpecLoop, Any, Req]:
    spec = Recording(pause_unprofitable=True)
    if decode_s is not None:
        spec.observe_step(False, 1, decode_s)
    spec.observe_step(True, 1, cycle_s)
    loop = SpecLoop(SimpleCycle(), None, spec, max_context=64)
    req = Req("r", [1, 2, 3, 4], greedy())
    req.state = ReqState.DECODE
    loop.reqs = [req]
    return loop, spec, req


class SimpleCycle(DeviceCycle):
    k, max_batch = K, 4

    def begin(self, reqs: Sequence[Any]) -> None: ...

    def launch(self) -> Callable[[], list[list[int]]]:
        raise AssertionError("not launched here")

    def end(self, reqs: Sequence[Any], trusted: Sequence[int]) -> None: ...


def _episode(loop: SpecLoop, spec: Any, req: Req, gains: Sequence[int]) -> int:
    """Judge one cycle per gain (tokens) from a fresh start; the pause it ended in, in steps
    (0: none)."""
    loop._deficit = loop._episode = 0.0
    for g in gains:
        loop._judge([req], [g - 1])
    steps = 0
    while not spec.wants(req):
        steps += 1
    return steps


def test_a_deficit_exactly_at_the_threshold_does_not_stop_the_loop() -> None:
    loop, spec, req = _judged()  # break-even 1.5: a cycle gaining 1 loses 0.5
    assert _episode(loop, spec, req, [1] * 4) == 0 and loop._deficit == 2.0
    assert _episode(loop, spec, req, [1] * 5) == 4 and loop.verdicts == 1


def test_an_episode_that_broke_even_pauses_briefly() -> None:
    """After a losing episode the next pause would be 8 steps; one that gained exactly what it
    lost (2.5 tokens, then five cycles losing 0.5) pauses FIRST_PAUSE steps."""
    loop, spec, req = _judged()
    assert _episode(loop, spec, req, [1] * 5) == 4 and loop._pause == 8
    assert _episode(loop, spec, req, [4] + [1] * 5) == 4 and loop._pause == 8
    assert _episode(loop, spec, req, [1] * 5) == 8 and loop._pause == 16
    assert loop.verdicts == 3


def test_only_recent_restarts_price_a_stop() -> None:
    """Nine restarts of 2.5 s (10 decode steps) then eight instant ones: the recent eight
    say a restart costs nothing, so a deficit of 2.5 stops the loop."""
    loop, spec, req = _judged()
    loop._restarts.extend([2.5] * 9 + [0.0] * 8)
    assert _episode(loop, spec, req, [1] * 5) == 4


def test_without_a_decode_step_once_the_probes_ran_out_nothing_is_judged() -> None:
    loop, spec, req = _judged(decode_s=None)
    for _ in range(3):  # each verify step probes once: a pause of a few steps
        spec.stats.verify_steps += 1
        assert _episode(loop, spec, req, [1]) > 0
    spec.stats.verify_steps += 1
    assert _episode(loop, spec, req, [1] * 10) == 0 and loop.verdicts == 0
