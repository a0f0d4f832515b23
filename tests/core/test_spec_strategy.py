"""Speculation, the step strategy (core/spec_strategy.py), without a model: a scripted
speculative algorithm behind the real Speculator, on a real Scheduler driven by hand (allocator,
slot table, radix cache, stop checker). Checked exactly: who drafts how far (budgets, the
context, pauses, uniform drafts with their filler, trees, adaptive lengths), the KV slots drafts
hold, a tree's slots put in path order at commit, what the policy is told, the verify rows a
step gets (chains, pending drafts, trees on scratch rows), the verify's sampling on hand-made
logits, the device loop's turn and its failure, and the stats /server_info shows."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hand_scheduler import hand_scheduler

from radixserve.core.interfaces import DeviceCycle, Draft, SpeculativeAlgorithm, StepStrategy
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.request import Req, ReqState, SamplingParams
from radixserve.core.scheduler import Scheduler
from radixserve.core.spec_adaptive import AdaptiveDrafting
from radixserve.core.spec_loop import SpecLoop
from radixserve.core.spec_strategy import (
    Speculation,
    _draft_gain,
    _padded,
    is_reference_step,
    loop_of,
    speculation_of,
    speculator_of,
)
from radixserve.core.speculative import Speculator
from radixserve.core.step_plan import StepPlan
from radixserve.core.step_rows import LogitsPlan, StepRows
from radixserve.core.tokenizer import Tokenizer

EOS = 0
FIRST = 7  # what every prefill samples
CONTEXT = 64


class Script(SpeculativeAlgorithm):
    """Drafts what the test set for each request (cut to its limit); trees where set."""

    drafts_trees = True

    def __init__(self) -> None:
        self.chains: dict[str, list[int]] = {}
        self.trees: dict[str, Draft] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.released: list[str] = []
        self.hidden: list[Any] = []
        self.fail = False

    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        self.calls.append(("chain", [r.rid for r in reqs], list(max_drafts)))
        if self.fail:
            raise RuntimeError("drafter down")
        pairs = zip(reqs, max_drafts, strict=True)
        return [Draft(self.chains.get(r.rid, [])[:m]) for r, m in pairs]

    def propose_trees(
        self, reqs: Sequence[Any], max_depths: Sequence[int], max_nodes: Sequence[int]
    ) -> list[Draft]:
        self.calls.append(("tree", [r.rid for r in reqs], list(max_depths), list(max_nodes)))
        out = []
        for r, m, n in zip(reqs, max_depths, max_nodes, strict=True):
            tree = self.trees.get(r.rid)
            out.append(tree if tree is not None and n else Draft(self.chains.get(r.rid, [])[:m]))
        return out

    def release(self, rid: str) -> None:
        self.released.append(rid)

    def target_hidden(self, batch: Any) -> None:
        self.hidden.append(batch)


def speculator(num_draft: int = 3, **kw: Any) -> Speculator:
    kw.setdefault("pause_unprofitable", False)
    return Speculator(Script(), "script", num_draft, kw.pop("disable", 16), vocab_size=362, **kw)


def make(
    tokenizer: Tokenizer,
    spec: Speculator,
    *,
    pool: int = 256,
    running: int = 8,
    runner: Any = None,
    host: Any = None,
    scratch: int = 0,
) -> tuple[Scheduler, Speculation]:
    strategy = Speculation(spec, runner, CONTEXT, False, host)
    sched = hand_scheduler(
        tokenizer, EOS, pool=pool, context=CONTEXT, running=running, extra_rows=scratch,
        strategies=[strategy],
    )  # fmt: skip
    return sched, strategy


def greedy(max_new_tokens: int = 40, **kw: Any) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


def prompt(rid: str, n: int = 4, start: int = 10, **kw: Any) -> Req:
    return Req(rid, list(range(start, start + n)), greedy(**kw))


def decoding(sched: Scheduler, *reqs: Req) -> list[Req]:
    """``reqs`` prefilled (each samples FIRST): decoding, their last token on the host."""
    for r in reqs:
        sched.add_request(r)
    plan = sched.schedule()
    assert plan is not None and not plan.extra
    sched.process_output(plan, {i: (FIRST, None, None) for i in sched.needs_sampling(plan)})
    assert all(r.state == ReqState.DECODE and not r.num_pending for r in reqs)
    return list(reqs)


def accept_all(plan: StepPlan, sched: Scheduler, token: int = 30) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for i in sched.needs_sampling(plan):
        if i in plan.extra:
            out[i] = [(t, None, None) for t in plan.extra[i].tokens] + [(token, None, None)]
        else:
            out[i] = (token, None, None)
    return out


def check_accounting(sched: Scheduler) -> None:
    acct = sched.kv_accounting()
    held = sum(r.kv_len - r.prefix_len for r in sched.running)
    assert acct["in_use"] == held, (acct, sched.running)


def script(spec: Speculator) -> Script:
    assert isinstance(spec.algorithm, Script)
    return spec.algorithm


# -- finding the strategy, its stats --------------------------------------------------------------


def test_the_strategy_its_speculator_and_loop_are_found_among_the_cores_strategies() -> None:
    spec = speculator()
    strategy = Speculation(spec, None, CONTEXT, False)
    strategy.loop = SpecLoop(SimpleNamespace(k=2), None, spec, CONTEXT)  # type: ignore[arg-type]
    core = SimpleNamespace(strategies=[StepStrategy(), strategy])
    assert speculation_of(core) is strategy and speculator_of(core) is spec
    assert loop_of(core) is strategy.loop
    plain = SimpleNamespace(strategies=[StepStrategy()])
    assert speculation_of(plain) is None and speculator_of(plain) is None
    assert loop_of(plain) is None


def test_spec_stats_name_the_settings_and_count_verifies() -> None:
    spec = Speculator(Script(), "script", 3, 12, vocab_size=362, simulate_accept_len=2.5)
    strategy = Speculation(spec, None, CONTEXT, False)
    req = prompt("r")
    spec.verified([req], [3], [2], 1)
    assert strategy.spec_stats() == {
        "algorithm": "script",
        "num_draft_tokens": 3,
        "disable_batch_size": 12,
        "simulated_accept_len": 2.5,
        "adaptive": False,
        "verify_steps": 1,
        "verified_requests": 1,
        "draft_tokens": 3,
        "accepted_tokens": 2,
        "avg_accept_length": 3.0,
        "trees": 0,
    }
    adaptive = Speculation(speculator(adaptive=AdaptiveDrafting(3)), None, CONTEXT, False)
    assert adaptive.spec_stats()["adaptive"] is True  # type: ignore[index]


def test_closing_lets_go_of_the_loop_and_the_algorithm() -> None:
    spec = speculator()
    strategy = Speculation(spec, None, CONTEXT, False)
    strategy.loop = SpecLoop(SimpleNamespace(k=2), None, spec, CONTEXT)  # type: ignore[arg-type]
    strategy.close()
    assert strategy.loop is None and spec.algorithm is None


# -- who drafts, how far ---------------------------------------------------------------------------


def test_drafts_stop_at_the_budget_and_the_context_and_hold_only_their_slots(
    tokenizer: Tokenizer,
) -> None:
    spec = speculator(4)
    sched, _ = make(tokenizer, spec)
    near_budget = prompt("budget", max_new_tokens=3)  # 1 out, 2 left: 1 draft
    near_end = prompt("end", n=CONTEXT - 4, start=0)  # seq_len 61: 3 left, 2 drafts
    full = prompt("full", start=100)
    decoding(sched, near_budget, near_end, full)
    script(spec).chains = {"budget": [21, 22, 23, 24], "end": [31, 32, 33], "full": [41, 42]}
    free = sched.allocator.available()
    plan = sched.schedule()
    assert plan is not None
    assert script(spec).calls == [("chain", ["budget", "end", "full"], [1, 2, 4])]
    assert {plan.reqs[i].rid: d.tokens for i, d in plan.extra.items()} == {
        "budget": [21],
        "end": [31, 32],
        "full": [41, 42],  # 2 of 4 drafted: the other two slots went back
    }
    assert sched.allocator.available() == free - 3 - (1 + 2 + 2)
    sched.process_output(plan, accept_all(plan, sched))
    check_accounting(sched)


def test_a_paused_request_decodes_plainly_unless_drafts_are_uniform(tokenizer: Tokenizer) -> None:
    spec = speculator(3)
    sched, strategy = make(tokenizer, spec)
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    script(spec).chains = {"a": [21, 22, 23], "b": [31, 32, 33]}
    spec.pause([b], 4, probe=True)
    plan = sched.schedule()
    assert plan is not None
    assert {plan.reqs[i].rid for i in plan.extra} == {"a"} and strategy.filler_only == set()
    sched.process_output(plan, accept_all(plan, sched))
    check_accounting(sched)


def test_uniform_drafts_pad_to_one_length_and_give_paused_requests_filler(
    tokenizer: Tokenizer,
) -> None:
    """With uniform drafts a short draft repeats its last token up to the step's length, a
    paused request verifies filler (its last token) and is not judged, and a request near its
    budget drafts the full length (cut at commit, counted as kept)."""
    spec = speculator(3)
    sched, strategy = make(tokenizer, spec)
    strategy.uniform = True
    a, b, c = decoding(
        sched, prompt("a", max_new_tokens=3), prompt("b", start=30), prompt("c", start=50)
    )
    script(spec).chains = {"a": [21, 22, 23], "b": [31], "c": [41, 42, 43]}
    spec.pause([c], 4, probe=True)
    free = sched.allocator.available()
    plan = sched.schedule()
    assert plan is not None
    drafts = {plan.reqs[i].rid: d.tokens for i, d in plan.extra.items()}
    assert drafts == {"a": [21, 22, 23], "b": [31, 31, 31], "c": [FIRST] * 3}
    assert script(spec).calls == [("chain", ["a", "b"], [3, 3])]
    assert strategy.filler_only == {"c"} and strategy._real == {"a": 3, "b": 1}
    assert sched.allocator.available() == free - 3 - 3 * 3
    sched.process_output(plan, accept_all(plan, sched))
    # a: 2 tokens of its budget were left: 1 accepted draft counted; b: 3 drafts, all kept
    assert a.finished and a.output_ids == [FIRST, 21, 22]
    assert spec.stats.verified == 2 and spec.stats.draft_tokens == 1 + 3
    assert spec.stats.accepted_tokens == 1 + 3
    assert b.spec_verify_ct == 1 and c.spec_verify_ct == 0
    check_accounting(sched)


def test_uniform_filler_needs_its_slots(tokenizer: Tokenizer) -> None:
    spec = speculator(3)
    sched, strategy = make(tokenizer, spec)
    strategy.uniform = True
    a, c = decoding(sched, prompt("a"), prompt("c", start=50))
    script(spec).chains = {"a": [21, 22, 23]}
    spec.pause([c], 4, probe=True)
    # the decodes' slots (2) and a's 3 drafts, none left for c's filler
    taken = sched.allocator.alloc(sched.allocator.available() - 5)
    assert taken is not None
    plan = sched.schedule()
    assert plan is not None and [plan.reqs[i].rid for i in plan.extra] == ["a"]
    assert strategy.filler_only == set() and sched.allocator.available() == 0
    sched.allocator.free(taken)


def test_padding_leaves_drafts_it_cannot_extend_alone() -> None:
    req = prompt("r")
    assert _padded(req, 3, Draft([5])).tokens == [5, 5, 5]
    assert _padded(req, 2, Draft([5])).tokens == [5, 5]
    assert _padded(req, 3, Draft([])).tokens == [13] * 3  # the prompt's last token
    req.output_ids = [8]
    assert _padded(req, 2, Draft([])).tokens == [8, 8]
    full = Draft([5, 6])
    assert _padded(req, 2, full) is full and _padded(req, 1, full) is full
    for draft in (
        Draft([5], probs=torch.ones(1, 4)),
        Draft([0], pending=torch.tensor([5])),
        Draft([5], parents=[-1]),
    ):
        assert _padded(req, 3, draft) is draft
    req.grammar = object()
    constrained = Draft([5])
    assert _padded(req, 3, constrained) is constrained


def test_a_drafts_gain_is_a_chains_length_or_a_trees_depth() -> None:
    assert _draft_gain(Draft([1, 2, 3])) == 3
    assert _draft_gain(Draft([1, 2, 3, 4], parents=[-1, -1, 0, 2])) == 3
    assert _draft_gain(Draft([], parents=[])) == 0


def test_adaptive_lengths_come_from_the_policys_plan(tokenizer: Tokenizer) -> None:
    adaptive, twin = AdaptiveDrafting(3), AdaptiveDrafting(3)
    spec = speculator(3, adaptive=adaptive)
    sched, strategy = make(tokenizer, spec)
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    for _ in range(6):
        adaptive.observed("b", 3, 0)  # b never accepts
        twin.observed("b", 3, 0)
    script(spec).chains = {"a": [21, 22, 23], "b": [31, 32, 33]}
    expected = twin.plan(["a", "b"], 2)
    plan = sched.schedule()
    assert plan is not None
    assert script(spec).calls[0][2] == [expected[r] for r in script(spec).calls[0][1]]
    assert {plan.reqs[i].rid: len(d.tokens) for i, d in plan.extra.items()} == {
        rid: n for rid, n in expected.items() if n
    }
    sched.process_output(plan, accept_all(plan, sched))
    # commit: the policy sees what each drafted itself (not padding) and kept
    twin.observed("a", expected["a"], expected["a"])
    assert adaptive.accept_prob("a") == twin.accept_prob("a")
    assert strategy._real == {}


def test_adaptive_plans_requests_whose_token_is_still_on_the_device(tokenizer: Tokenizer) -> None:
    adaptive = AdaptiveDrafting(3)
    spec = speculator(3, adaptive=adaptive)
    sched, strategy = make(tokenizer, spec)
    (a,) = decoding(sched, prompt("a"))
    a.num_pending = 1
    assert strategy.extend_plan(sched, [a]) == {}
    assert adaptive.steps_planned == 1 and script(spec).calls == []
    a.state = ReqState.PREFILL
    assert strategy.extend_plan(sched, [a]) == {} and adaptive.steps_planned == 1
    a.state, a.num_pending = ReqState.DECODE, 0


def test_uniform_adaptive_drafts_share_one_length(tokenizer: Tokenizer) -> None:
    adaptive, twin = AdaptiveDrafting(3), AdaptiveDrafting(3)
    spec = speculator(3, adaptive=adaptive)
    sched, strategy = make(tokenizer, spec)
    strategy.uniform = True
    decoding(sched, prompt("a"), prompt("b", start=30))
    for _ in range(3):
        adaptive.observed("b", 3, 1)
        twin.observed("b", 3, 1)
    expected = twin.plan(["a", "b"], 2, uniform=True)
    script(spec).chains = {"a": [21, 22, 23], "b": [31, 32, 33]}
    plan = sched.schedule()
    assert plan is not None and len(set(expected.values())) == 1
    assert script(spec).calls[0][2] == [expected["a"]] * 2


def test_trees_while_few_requests_draft_and_not_at_the_context(tokenizer: Tokenizer) -> None:
    spec = speculator(2, tree_nodes=4)
    sched, _ = make(tokenizer, spec)
    tree = Draft([21, 22, 23], parents=[-1, -1, 1])
    near_end = prompt("end", n=CONTEXT - 5, start=0)  # seq_len 60: 60 + 4 nodes reach 64
    a = prompt("a", start=100)
    decoding(sched, a, near_end)
    script(spec).trees = {"a": tree, "end": tree}
    script(spec).chains = {"end": [31, 32]}
    free = sched.allocator.available()
    plan = sched.schedule()
    assert plan is not None
    assert script(spec).calls == [("tree", ["a", "end"], [2, 2], [4, 0])]
    drafts = {plan.reqs[i].rid: d for i, d in plan.extra.items()}
    assert drafts["a"].tokens == [21, 22, 23] and drafts["a"].parents == [-1, -1, 1]
    assert drafts["end"].tokens == [31, 32] and drafts["end"].parents is None
    assert sched.allocator.available() == free - 2 - 3 - 2  # a's 4th node slot went back
    assert spec.stats.trees == 1


def test_no_trees_when_more_than_a_few_requests_draft(tokenizer: Tokenizer) -> None:
    spec = speculator(2, tree_nodes=4)
    sched, _ = make(tokenizer, spec)
    reqs = [prompt(f"r{i}", start=10 + 20 * i) for i in range(5)]
    decoding(sched, *reqs)
    plan = sched.schedule()
    assert plan is not None and script(spec).calls == [("chain", [r.rid for r in reqs], [2] * 5)]
    spec.pause(reqs[:1], 1, probe=True)  # four draft: trees again
    sched.process_output(plan, accept_all(plan, sched))
    sched.schedule()
    assert script(spec).calls[-1] == ("tree", [r.rid for r in reqs[1:]], [2] * 4, [4] * 4)


def test_adaptive_trees_take_the_policys_width(tokenizer: Tokenizer) -> None:
    adaptive, twin = AdaptiveDrafting(2, tree_nodes=6), AdaptiveDrafting(2, tree_nodes=6)
    spec = speculator(2, tree_nodes=6, adaptive=adaptive)
    sched, _ = make(tokenizer, spec)
    decoding(sched, prompt("a"))
    for d in (adaptive, twin):  # a accepts half its drafts: a wider tree than a newcomer's
        d.observed("a", 2, 1)
    depth = twin.plan(["a"], 1)["a"]
    plan = sched.schedule()
    assert plan is not None and depth > 0
    nodes = twin.tree_nodes_for("a", depth)
    assert nodes != twin.tree_nodes_for("new", depth)
    assert script(spec).calls == [("tree", ["a"], [depth], [nodes])]


def test_a_failing_drafter_leaves_plain_decodes(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    spec = speculator(3)
    sched, _ = make(tokenizer, spec)
    decoding(sched, prompt("a"))
    script(spec).chains = {"a": [21, 22, 23]}
    script(spec).fail = True
    free = sched.allocator.available()
    with caplog.at_level(logging.ERROR, logger="radixserve.core.spec_strategy"):
        plan = sched.schedule()
    assert plan is not None and plan.extra == {}
    assert sched.allocator.available() == free - 1
    assert [r.getMessage() for r in caplog.records] == [
        "speculative plugin 'script' failed to propose"
    ]


def test_a_finished_request_is_forgotten(tokenizer: Tokenizer) -> None:
    spec = speculator(3)
    sched, strategy = make(tokenizer, spec)
    (a,) = decoding(sched, prompt("a", max_new_tokens=2))
    spec.pause([a], 3)
    strategy._real["a"] = 2
    plan = sched.schedule()
    assert plan is not None
    sched.process_output(plan, accept_all(plan, sched))
    assert a.finished and script(spec).released == ["a"] and strategy._real == {}
    assert "a" not in spec._payoff


# -- commit: trees put their path first -------------------------------------------------------


def test_a_trees_accepted_path_takes_the_first_positions(tokenizer: Tokenizer) -> None:
    spec = speculator(2, tree_nodes=4)
    sched, _ = make(tokenizer, spec)
    (a,) = decoding(sched, prompt("a"))
    script(spec).trees = {"a": Draft([21, 22, 23], parents=[-1, -1, 1])}
    plan = sched.schedule()
    assert plan is not None and a.req_pool_idx is not None
    row = sched.req_to_token.table[a.req_pool_idx]
    before = row[4:8].tolist()  # the last token's slot, then nodes 0, 1, 2
    free = sched.allocator.available()
    # the target takes 22 (node 1), then 23 (node 2), then emits 30
    sched.process_output(plan, {0: [(22, None, None), (23, None, None), (30, None, None)]})
    assert a.output_ids == [FIRST, 22, 23, 30] and a.kv_len == 7
    # the path's slots first, node 0's after them (then freed: its position is past the end)
    assert row[4:8].tolist() == [before[0], before[2], before[3], before[1]]
    assert sched.allocator.available() == free + 1  # node 0's slot
    check_accounting(sched)


def test_a_tree_path_already_in_order_and_a_chain_keep_their_slots(
    tokenizer: Tokenizer,
) -> None:
    spec = speculator(2, tree_nodes=4)
    sched, _ = make(tokenizer, spec)
    (a,) = decoding(sched, prompt("a"))
    script(spec).trees = {"a": Draft([21, 22, 23], parents=[-1, -1, 0])}
    plan = sched.schedule()
    assert plan is not None and a.req_pool_idx is not None
    row = sched.req_to_token.table[a.req_pool_idx]
    before = row[4:8].tolist()
    sched.process_output(plan, {0: [(21, None, None), (30, None, None)]})  # node 0, then 30
    assert row[4:8].tolist() == before and a.kv_len == 6
    check_accounting(sched)


# -- the runner: verify rows, hidden states, sampling ---------------------------------------------


def _placed(table: ReqToTokenPool, rid: str, row: int, kv_len: int, out: list[int]) -> Req:
    req = prompt(rid)
    req.req_pool_idx, req.kv_len, req.output_ids = row, kv_len, out
    req.state = ReqState.DECODE
    table.write(row, 0, torch.arange(100 * (row + 1), 100 * (row + 1) + 20))
    return req


def test_a_chain_verifies_the_last_token_then_its_draft() -> None:
    table = ReqToTokenPool(4, 32)
    strategy = Speculation(speculator(), None, CONTEXT, False)
    other = _placed(table, "o", 0, 4, [FIRST])
    req = _placed(table, "r", 1, 5, [FIRST, 8])  # the last token, 8, at position 5
    rows = StepRows()
    rows.add_decode(other)
    assert strategy.add_rows(rows, 1, req, 3, Draft([21, 22]))
    assert rows.input_ids == [FIRST, 8, 21, 22]
    assert rows.positions == [4, 5, 6, 7] and rows.rows == [0, 1, 1, 1]
    assert rows.logits_rows == [0, 1, 2, 3] and rows.seq_lens == [5, 8]
    assert rows.plans == [LogitsPlan(range(0), 0, 0), LogitsPlan(range(0), 1, 3)]
    assert rows.device_dst == [] and rows.device_tokens == []


def test_a_pending_draft_is_read_on_the_device() -> None:
    table = ReqToTokenPool(4, 32)
    strategy = Speculation(speculator(), None, CONTEXT, False)
    other = _placed(table, "o", 0, 4, [FIRST])
    req = _placed(table, "r", 1, 5, [FIRST, 8])
    pending = torch.tensor([21, 22])
    rows = StepRows()
    rows.add_decode(other)
    strategy.add_rows(rows, 1, req, 3, Draft([0, 0], pending=pending))
    assert rows.input_ids == [FIRST, 8, 0, 0] and rows.device_dst == [2, 3]
    assert len(rows.device_tokens) == 1 and rows.device_tokens[0] is pending


def test_a_tree_verifies_as_decode_rows_on_scratch_rows() -> None:
    """The root on the request's own row; node j on a scratch row holding the prefix, its
    ancestors' slots and its own (position kv_len + 1 + j's slot)."""
    table = ReqToTokenPool(8, 32)
    runner = SimpleNamespace(scratch_rows=[5, 6, 7, 4], req_to_token=table)
    strategy = Speculation(speculator(), runner, CONTEXT, False)
    req = _placed(table, "r", 1, 4, [FIRST])  # slots 200.. ; last token at position 4
    rows = StepRows()
    draft = Draft([21, 22, 23], parents=[-1, -1, 1])
    assert strategy.add_rows(rows, 0, req, 4, draft)
    assert rows.input_ids == [FIRST, 21, 22, 23]
    assert rows.rows == [1, 5, 6, 7] and rows.positions == [4, 5, 5, 6]
    assert rows.seq_lens == [5, 6, 6, 7] and rows.logits_rows == [0, 1, 2, 3]
    assert rows.as_decodes == {0: 4} and rows.plans == [LogitsPlan(range(0), 0, 3)]
    prefix = [200, 201, 202, 203, 204]
    assert table.table[5, :6].tolist() == prefix + [205]
    assert table.table[6, :6].tolist() == prefix + [206]
    assert table.table[7, :7].tolist() == prefix + [206, 207]
    # a second tree in the step takes the next scratch rows
    other = _placed(table, "o", 2, 4, [9])
    strategy.add_rows(rows, 1, other, 2, Draft([31], parents=[-1]))
    assert rows.input_ids[4:] == [9, 31]
    assert rows.rows[4:] == [2, 4] and rows.as_decodes == {0: 4, 1: 2}
    assert table.table[4, :6].tolist() == [300, 301, 302, 303, 304, 305]
    assert rows.plans[1] == LogitsPlan(range(0), 4, 5)


def test_hidden_states_go_to_the_drafter_after_each_forward() -> None:
    spec = speculator()
    algorithm = script(spec)
    runner = SimpleNamespace(plugins=SimpleNamespace(names={"model": "m", "speculative": "s"}))
    strategy = Speculation(spec, runner, CONTEXT, False)
    batch = SimpleNamespace(capture_hidden_layers=(), hidden_consumed=False, hidden_states=None)
    strategy.before_forward(batch)  # type: ignore[arg-type]
    assert batch.capture_hidden_layers == ()
    strategy.after_forward(batch)  # type: ignore[arg-type]
    algorithm.capture_hidden_layers = (2, 5)
    strategy.before_forward(batch)  # type: ignore[arg-type]
    assert batch.capture_hidden_layers == (2, 5)
    with pytest.raises(RuntimeError) as e:
        strategy.after_forward(batch)  # type: ignore[arg-type]
    assert str(e.value) == (
        "model plugin 'm' keeps no hidden states (ForwardBatch.capture_hidden_layers), "
        "which the speculative plugin 's' needs"
    )
    batch.hidden_states = {2: "h"}
    strategy.after_forward(batch)  # type: ignore[arg-type]
    assert algorithm.hidden == [batch]
    batch.hidden_consumed = True  # a captured graph handed them on already
    strategy.after_forward(batch)  # type: ignore[arg-type]
    assert algorithm.hidden == [batch]


def _logits(argmax: list[int], vocab: int = 40) -> torch.Tensor:
    out = torch.zeros(len(argmax), vocab)
    out[torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
    return out


def test_a_verify_step_samples_each_entrys_rows() -> None:
    spec = speculator()
    runner = SimpleNamespace(grammar_masker=None)
    strategy = Speculation(spec, runner, CONTEXT, False)
    a, b = prompt("a"), prompt("b")
    plans = [LogitsPlan(range(0), 0, 0), LogitsPlan(range(0), 1, 3)]
    plain = StepPlan([a, b], [1, 3], 2)
    assert strategy.sample_rows(_logits([5]), plain, plans, [0, 1], [EOS]) is None
    plan = StepPlan([a, b], [1, 3], 1, {1: Draft([21, 22])})
    # b: 21 accepted, 22 rejected (the target says 30)
    out = strategy.sample_rows(_logits([5, 21, 30, 9]), plan, plans, [0, 1], [EOS])
    assert out is not None
    assert {i: [t for t, *_ in v] if isinstance(v, list) else v[0] for i, v in out.items()} == {
        0: 5,
        1: [21, 30],
    }
    # only b samples (a is a prefill chunk that goes on): its rows alone
    out = strategy.sample_rows(_logits([5, 21, 22, 9]), plan, plans, [1], [EOS])
    assert out is not None and [t for t, *_ in out[1]] == [21, 22, 9]
    # rows past the sampled ones (scored prompt positions) are left out
    first = [LogitsPlan(range(0), 0, 2), LogitsPlan(range(0), 3, 3)]
    plan = StepPlan([b, a], [3, 1], 1, {0: Draft([21, 22])})
    out = strategy.sample_rows(_logits([21, 22, 9, 6, 7]), plan, first, [0, 1], [EOS])
    assert out is not None and [t for t, *_ in out[0]] == [21, 22, 9] and out[1][0] == 6


# -- step timing --------------------------------------------------------------------------------


def test_reference_steps_are_decodes_and_verifies_only() -> None:
    a, b = prompt("a"), prompt("b")
    verify = StepPlan([a, b], [1, 3], 1, {1: Draft([1, 2])})
    decode = StepPlan([a, b], [1, 1], 2)
    mixed = StepPlan([a, b], [1, 4], 1)
    assert is_reference_step(verify, False, True) and is_reference_step(verify, True, True)
    assert not is_reference_step(decode, False, True)
    assert is_reference_step(decode, True, True) and is_reference_step(decode, False, False)
    assert not is_reference_step(mixed, True, False)


class Timed(Speculator):
    def __init__(self) -> None:
        super().__init__(Script(), "script", 3, 16, vocab_size=362)
        self.steps: list[tuple[Any, ...]] = []

    def observe_step(self, verify: bool, batch_size: int, seconds: float, **kw: Any) -> None:
        self.steps.append((verify, batch_size, seconds, kw))


def test_step_times_go_to_the_policy_with_catch_ups_marked() -> None:
    spec = Timed()
    strategy = Speculation(spec, None, CONTEXT, True)
    a, b = prompt("a"), prompt("b")
    both = StepPlan([a, b], [3, 4], 0, {0: Draft([1, 2]), 1: Draft([1, 2, 3])})
    one = StepPlan([a, b], [1, 3], 1, {1: Draft([1, 2])})
    decode = StepPlan([a, b], [1, 1], 2)
    strategy.step_done(both, 0.5, False)
    strategy.step_done(both, 0.25, False)
    strategy.step_done(one, 0.125, False)  # b drafted last step: no catch-up
    strategy.step_done(decode, 0.1, False)  # not overlapped: not counted
    strategy.step_done(decode, 0.2, True)
    strategy.step_done(one, 0.3, False)  # b drafts again after a step without
    kw = {"catching_up": True, "draft_rows": 5}
    assert spec.steps == [
        (True, 2, 0.5, kw),
        (True, 2, 0.25, {"catching_up": False, "draft_rows": 5}),
        (True, 2, 0.125, {"catching_up": False, "draft_rows": 2}),
        (False, 2, 0.2, {"catching_up": False, "draft_rows": 0}),
        (True, 2, 0.3, {"catching_up": True, "draft_rows": 2}),
    ]


# -- the device loop's turn -----------------------------------------------------------------------


class Cycle(DeviceCycle):
    """Every cycle accepts one draft: emits 30 + its count, twice (t0, t1), then a = 1."""

    def __init__(self, k: int = 2, max_batch: int = 4) -> None:
        self.k, self.max_batch = k, max_batch
        self.launches = 0
        self.fail_begin = self.fail_launch = False

    def begin(self, reqs: Sequence[Any]) -> None:
        if self.fail_begin:
            raise RuntimeError("no graph")
        self.n = len(reqs)

    def launch(self) -> Callable[[], list[list[int]]]:
        if self.fail_launch:
            raise ValueError("device lost")
        self.launches += 1
        t = 30 + self.launches
        rows = [[t, t, t, 1] for _ in range(self.n)]
        return lambda: rows

    def end(self, reqs: Sequence[Any], trusted: Sequence[int]) -> None:
        pass


def _looping(
    tokenizer: Tokenizer, cycle: Cycle, host: Any = None
) -> tuple[Scheduler, Speculation, list[Req]]:
    spec = speculator(2)
    sched, strategy = make(tokenizer, spec, host=host)
    strategy.loop = SpecLoop(cycle, sched, spec, CONTEXT)
    reqs = decoding(sched, prompt("a"), prompt("b", start=30))
    return sched, strategy, reqs


def test_the_loop_runs_its_own_steps_while_it_can(tokenizer: Tokenizer) -> None:
    stats: list[dict[str, Any]] = []

    def step_finished(stats: dict[str, Any]) -> None:  # the plugins' hook, as pluggy calls it
        recorded.append(stats)

    recorded = stats
    host = SimpleNamespace(hook=SimpleNamespace(step_finished=step_finished))
    cycle = Cycle()
    sched, strategy, (a, b) = _looping(tokenizer, cycle, host)
    assert strategy.needs_host_tokens(sched)
    assert not strategy.has_work() and strategy.drain(sched) == []
    assert strategy.run_own_step(sched, hold=True) == ([], False)  # held: no start
    assert not strategy.has_work()
    t0 = time.perf_counter()
    assert strategy.run_own_step(sched, hold=False) == ([], True)  # started, a cycle launched
    assert strategy.has_work() and cycle.launches == 1
    assert strategy.run_own_step(sched, hold=False) == ([a, b], True)
    assert a.output_ids == [FIRST, 31, 31] and cycle.launches == 2
    assert [{k: v for k, v in s.items() if k != "step_time_s"} for s in stats] == [
        {"num_decode": 2, "num_prefill_tokens": 0, "num_running": 2, "num_waiting": 0}
    ] * 2
    assert all(0 <= s["step_time_s"] <= time.perf_counter() - t0 for s in stats)
    sched.add_request(prompt("w", start=90))  # an arrival drains the loop
    assert strategy.run_own_step(sched, hold=False) == ([a, b], False)
    assert not strategy.has_work() and a.output_ids[-2:] == [32, 32]
    assert strategy.run_own_step(sched, hold=False) == ([], False)  # nothing eligible
    check_accounting(sched)


def test_holding_drains_a_running_loop(tokenizer: Tokenizer) -> None:
    sched, strategy, (a, b) = _looping(tokenizer, Cycle())
    strategy.run_own_step(sched, hold=False)
    assert strategy.drain(sched) == [a, b] and not strategy.has_work()
    strategy.run_own_step(sched, hold=False)
    assert strategy.run_own_step(sched, hold=True) == ([a, b], False)
    check_accounting(sched)


def test_without_a_loop_or_slots_the_loop_takes_no_step(tokenizer: Tokenizer) -> None:
    spec = speculator(2)
    sched, strategy = make(tokenizer, spec)
    decoding(sched, prompt("a"))
    assert strategy.run_own_step(sched, hold=False) == ([], False)
    strategy.loop = SpecLoop(Cycle(), sched, spec, CONTEXT)
    taken = sched.allocator.alloc(sched.allocator.available())
    assert strategy.run_own_step(sched, hold=False) == ([], False)
    assert not strategy.has_work()
    sched.allocator.free(taken)


@pytest.mark.parametrize("where", ["begin", "launch"])
def test_a_failing_cycle_aborts_its_requests_and_the_engine_goes_on(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    cycle = Cycle()
    sched, strategy, (a, b) = _looping(tokenizer, cycle)
    setattr(cycle, f"fail_{where}", True)
    error = "RuntimeError: no graph" if where == "begin" else "ValueError: device lost"
    with caplog.at_level(logging.ERROR, logger="radixserve.core.spec_strategy"):
        changed, ran = strategy.run_own_step(sched, hold=False)
    assert ran and changed == [a, b] and not sched.running
    message = f"the engine failed on this request's step ({error})"
    for req in (a, b):
        assert req.finished and req.failed == message
        assert req.finish_reason is not None and req.finish_reason.message == message
    assert sched.cache.evictable_size == 0  # the cache was emptied
    assert sched.allocator.available() == sched.allocator.size
    detail = "RuntimeError('no graph')" if where == "begin" else "ValueError('device lost')"
    assert [r.getMessage() for r in caplog.records] == [
        f"a speculative cycle of 2 requests failed: {detail}; aborting them"
    ]
    assert not strategy.has_work()


def test_the_host_needs_tokens_only_where_a_request_may_draft(tokenizer: Tokenizer) -> None:
    spec = speculator(2, disable=1)
    sched, strategy = make(tokenizer, spec)
    assert not strategy.needs_host_tokens(sched)  # nothing runs
    (a,) = decoding(sched, prompt("a"))
    assert strategy.needs_host_tokens(sched)
    spec.pause([a], 2, probe=True)
    assert not strategy.needs_host_tokens(sched)
    decoding(sched, prompt("b", start=30))
    spec.forget("a")
    assert not strategy.needs_host_tokens(sched)  # two decodes: past disable_batch_size


def test_drafts_never_evict_the_cache(tokenizer: Tokenizer) -> None:
    """With one free slot and a finished request's prompt in the cache, the decode takes the
    slot and drafting gives up rather than evict."""
    spec = speculator(3)
    sched, _ = make(tokenizer, spec)
    a, done = prompt("a"), prompt("done", start=50, max_new_tokens=1)
    sched.add_request(a)
    sched.add_request(done)
    plan = sched.schedule()
    assert plan is not None
    sched.process_output(plan, accept_all(plan, sched, FIRST))
    assert done.finished and sched.cache.evictable_size == 4
    script(spec).chains = {"a": [21, 22, 23]}
    taken = sched.allocator.alloc(sched.allocator.available() - 1)
    plan = sched.schedule()
    assert plan is not None and plan.extra == {} and sched.cache.evictable_size == 4
    assert sched.allocator.available() == 0
    sched.allocator.free(taken)


def test_a_paused_request_first_in_the_step_leaves_the_others_counted(
    tokenizer: Tokenizer,
) -> None:
    spec = speculator(2)
    sched, strategy = make(tokenizer, spec)
    strategy.uniform = True
    a, b = decoding(sched, prompt("a"), prompt("b", start=30))
    spec.pause([a], 4, probe=True)
    script(spec).chains = {"b": [31, 32]}
    plan = sched.schedule()
    assert plan is not None and [plan.reqs[i].rid for i in sorted(plan.extra)] == ["a", "b"]
    sched.process_output(plan, accept_all(plan, sched))
    assert spec.stats.verified == 1 and b.spec_verify_ct == 1 and a.spec_verify_ct == 0


def test_the_adaptive_policy_sees_rejected_drafts(tokenizer: Tokenizer) -> None:
    adaptive, twin = AdaptiveDrafting(3), AdaptiveDrafting(3)
    spec = speculator(3, adaptive=adaptive)
    sched, _ = make(tokenizer, spec)
    (a,) = decoding(sched, prompt("a"))
    script(spec).chains = {"a": [21, 22, 23]}
    drafted = twin.plan(["a"], 1)["a"]
    plan = sched.schedule()
    assert plan is not None and len(plan.extra[0].tokens) == drafted > 1
    sched.process_output(plan, {0: [(21, None, None), (40, None, None)]})  # one accepted
    twin.observed("a", drafted, 1)
    assert adaptive.accept_prob("a") == twin.accept_prob("a")


def test_draining_without_a_loop_commits_nothing() -> None:
    strategy = Speculation(speculator(), None, CONTEXT, False)
    assert strategy.drain(None) == [] and not strategy.has_work()


def test_one_draft_token_still_needs_the_hosts_last_token(tokenizer: Tokenizer) -> None:
    spec = speculator(1)
    sched, strategy = make(tokenizer, spec)
    decoding(sched, prompt("a"))
    assert strategy.needs_host_tokens(sched)


class Masker:
    """Stands for the runner's GrammarMasker: bans token 22 on a constrained entry's rows."""

    def __init__(self) -> None:
        self.chains: list[tuple[int, Any, list[int]]] = []

    def apply_chains(self, logits: torch.Tensor, chains: Sequence[Any]) -> None:
        for first, grammar, draft in chains:
            self.chains.append((first, grammar, list(draft)))
            if grammar is not None:
                logits[first : first + len(draft) + 1, 22] = float("-inf")


def test_verify_sampling_masks_eos_and_grammars_as_plain_sampling_does() -> None:
    masker = Masker()
    strategy = Speculation(speculator(), SimpleNamespace(grammar_masker=masker), CONTEXT, False)
    early = prompt("early", min_new_tokens=5)  # EOS is masked until its 5th token
    early.output_ids = [FIRST]
    constrained = prompt("g")
    constrained.grammar = object()
    plans = [LogitsPlan(range(0), 0, 2), LogitsPlan(range(0), 3, 5)]
    plan = StepPlan([early, constrained], [3, 3], 0, {0: Draft([21, 22]), 1: Draft([21, 23])})
    logits = torch.zeros(6, 40)
    logits[:, 9] = 0.5  # everywhere the runner-up
    logits[0, EOS], logits[0, 21] = 2.0, 1.0  # early: EOS, masked, then its draft's 21
    logits[1, 22] = 1.0  # then its draft's 22
    logits[3, 21] = 1.0  # constrained: 21
    logits[4, 22] = 2.0  # 22 (banned by its grammar): the runner-up 9 rejects 23
    out = strategy.sample_rows(logits, plan, plans, [0, 1], [EOS])
    assert out is not None
    assert [t for t, *_ in out[0]] == [21, 22, 9] and [t for t, *_ in out[1]] == [21, 9]
    assert masker.chains == [(0, None, [21, 22]), (3, constrained.grammar, [21, 23])]
