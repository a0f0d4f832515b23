"""The scheduler with pages of 16 tokens, checked after every step: each running request's
positions sit in whole pages in order, no slot is used twice, and the pool is accounted for in
whole pages; through chunked prefill at unaligned offsets, shared prefixes, retraction and an
abort mid-prefill. Greedy outputs equal page size 1."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from platform_choice import CPU

from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, ReqState, SamplingParams

P = 16


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 360) for _ in range(n)]


def check_pages(core: EngineCore) -> None:
    sched, p = core.scheduler, core.runner.allocator.page_size
    table = core.runner.req_to_token.table
    in_tree = [s for node in sched.cache._all_nodes() for s in node.value.tolist()]
    own: list[int] = []
    held = 0
    for req in sched.running:
        if req.req_pool_idx is None:
            continue
        slots = table[req.req_pool_idx, : req.kv_len]
        pos = torch.arange(req.kv_len)
        first = slots[pos - pos % p]
        assert torch.equal(slots, first + pos % p), (req.rid, slots.tolist())
        assert req.prefix_len % p == 0
        own += slots[req.prefix_len :].tolist()
        held += -(-req.kv_len // p) * p - req.prefix_len
    assert len(set(own)) == len(own) and not set(own) & set(in_tree), "a slot is used twice"
    acct = sched.kv_accounting()
    assert acct["in_use"] == held, (acct, held)
    if not sched.running:
        sched.check_no_leak()


def run(model_dir: Path, page_size: int, abort_mid_prefill: bool) -> tuple[list[Req], int]:
    config = EngineConfig(
        page_size=page_size,
        max_total_tokens=240,
        chunked_prefill_size=24,
        max_running_requests=4,
        schedule_conservativeness=0.0,  # admission keeps no room back: retraction does the work
        # full prefill chunks beside decodes (as on GPUs): the traffic above is sized so that
        # this pool then runs out and retracts, whatever the CPU platform's default
        prefill_shrink_after_decodes=0,
        plugins=(CPU,),
    )
    core = EngineCore(model_dir, config, default_host())
    shared = tokens(1, 37)
    reqs = [Req(f"r{i}", shared + tokens(10 + i, 5 + 7 * i), SamplingParams(
        max_new_tokens=24, temperature=0.0, ignore_eos=True)) for i in range(5)]  # fmt: skip
    victim = Req("victim", shared + tokens(99, 50), SamplingParams(max_new_tokens=4))
    for req in [*reqs, victim]:
        core.add_request(req)
    for _ in range(2000):
        if not core.has_work():
            break
        core.step()
        check_pages(core)
        if abort_mid_prefill and victim.state == ReqState.PREFILL and victim.kv_len % P:
            assert core.abort("victim") is victim
            abort_mid_prefill = False
            check_pages(core)
    assert not core.has_work() and not abort_mid_prefill
    core.scheduler.check_no_leak()
    assert core.cache.locked_size == 0
    return reqs, core.scheduler.stats.retractions


def test_paged_scheduling_keeps_pages_whole_and_outputs_unchanged(tiny_llama_dir: Path) -> None:
    ref, _ = run(tiny_llama_dir, 1, abort_mid_prefill=False)
    paged, retractions = run(tiny_llama_dir, P, abort_mid_prefill=True)
    assert retractions > 0
    assert [r.output_ids for r in paged] == [r.output_ids for r in ref]
    assert all(len(r.output_ids) == 24 for r in paged)
