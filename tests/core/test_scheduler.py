"""Scheduler on a tiny random Llama through EngineCore: chunked prefill next to decodes, abort
in every state, KV accounting, retraction, admission order per policy, flush."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from platform_choice import on_cpu
from scheduler_checks import check_accounting, greedy, tokens
from tiny_models import make_tiny_llama_dir

from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, ReqState

# Every test runs with overlap scheduling off and on (on the CPU it is off by default; the
# overlapped path must keep every invariant and output of the synchronous one).
OVERLAP = {"on": False}


@pytest.fixture(autouse=True, params=["sync", "overlap"])
def schedule_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    OVERLAP["on"] = request.param == "overlap"
    yield
    OVERLAP["on"] = False


def make_core(model_dir: Path, **settings: object) -> EngineCore:
    settings.setdefault("max_total_tokens", 4096)
    settings.setdefault("enable_overlap_schedule", OVERLAP["on"])
    core = EngineCore(model_dir, EngineConfig(**on_cpu(settings)), default_host())
    core.scheduler.trace_steps = True
    return core


def add(core: EngineCore, rid: str, ids: list[int], max_new_tokens: int = 4) -> Req:
    req = Req(rid, list(ids), greedy(max_new_tokens))
    core.add_request(req)
    return req


def step(core: EngineCore) -> None:
    core.step()
    check_accounting(core)


def run_to_idle(core: EngineCore, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not core.has_work():
            return
        step(core)
    raise AssertionError(f"no progress after {max_steps} steps: {core.scheduler.running}")


def running_order(core: EngineCore) -> list[str]:
    return [r.rid for r in core.scheduler.running]


def solo_output(model_dir: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    core = make_core(model_dir)
    req = add(core, "solo", ids, max_new_tokens)
    run_to_idle(core)
    return req.output_ids


@pytest.fixture(scope="module")
def long_ctx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with room for a ~2,000-token prompt."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-4k"), max_position_embeddings=4096)


# -- chunked prefill ------------------------------------------------------------------------


def test_chunked_prefill_does_not_stall_running_decodes(long_ctx_dir: Path) -> None:
    budget = 256
    core = make_core(long_ctx_dir, chunked_prefill_size=budget, max_total_tokens=8192)
    sched = core.scheduler
    decoder = add(core, "decoder", tokens(1, 20), max_new_tokens=40)
    while decoder.state != ReqState.DECODE:
        step(core)
    long = add(core, "long", tokens(2, 2000), max_new_tokens=4)
    chunks: list[int] = []
    while core.has_work():
        # (with overlap, a request whose last token is still pending needs no more steps)
        decoding = [
            r
            for r in sched.running
            if r.state == ReqState.DECODE and r.num_output_tokens < r.sampling.max_new_tokens
        ]
        before = long.kv_len
        step(core)
        num_decode, prefill_tokens = sched.stats.step_trace[-1]
        if decoding:
            assert num_decode == len(decoding) > 0, sched.stats.step_trace[-1]
        assert num_decode + prefill_tokens <= budget
        if long.state == ReqState.PREFILL or (before < 2000 and long.kv_len >= 2000):
            chunks.append(long.kv_len - before)
            assert decoding == [decoder]  # the decoder ran next to every chunk
    assert sum(chunks) == 2000
    assert len(chunks) >= 2000 // budget + 1
    assert all(0 < c <= budget - 1 for c in chunks), chunks  # the decoder took one token each
    assert len(decoder.output_ids) == 40
    # Chunking changes nothing in the outputs.
    assert long.output_ids == solo_output(long_ctx_dir, tokens(2, 2000), 4)
    assert decoder.output_ids == solo_output(long_ctx_dir, tokens(1, 20), 40)


@pytest.mark.parametrize(("flag", "chunk", "origin"), [(None, 8, "cpu default"), (0, 84, "flag")])
def test_a_step_shared_by_many_decodes_takes_a_smaller_prefill_chunk(
    long_ctx_dir: Path, flag: int | None, chunk: int, origin: str
) -> None:
    """The CPU platform's default shrinks a step's prefill past 1 decode: 12 decodes next to a
    96-token chunk leave 96 * 1 / 12 = 8 prefill tokens; with the flag at 0, 96 - 12 = 84."""
    shrink = {} if flag is None else {"prefill_shrink_after_decodes": flag}
    core = make_core(long_ctx_dir, chunked_prefill_size=96, max_total_tokens=8192, **shrink)
    setting = core.runner.settings.describe()["prefill_shrink_after_decodes"]
    assert setting == {"value": 1 if flag is None else flag, "from": origin}
    decoders = [add(core, f"d{i}", tokens(30 + i, 8), max_new_tokens=200) for i in range(12)]
    while any(d.state != ReqState.DECODE for d in decoders):
        step(core)
    long = add(core, "long", tokens(2, 600), max_new_tokens=2)
    first = len(core.scheduler.stats.step_trace)
    while long.kv_len < 600:
        step(core)
    trace = core.scheduler.stats.step_trace[first:]
    assert all(num_decode == 12 for num_decode, _ in trace)
    assert [n for _, n in trace] == [chunk] * (600 // chunk) + [600 % chunk] * (600 % chunk > 0)


def test_without_mixing_prefills_run_alone_and_outputs_do_not_change(long_ctx_dir: Path) -> None:
    """--disable-mixed-chunk: no step holds both decodes and prefill tokens (decodes wait while
    a prompt is prefilled), and greedy outputs are those of the mixed default."""
    outputs = {}
    for mixed in (True, False):
        core = make_core(
            long_ctx_dir, chunked_prefill_size=64, max_total_tokens=8192,
            disable_mixed_chunk=not mixed,
        )  # fmt: skip
        reqs = [add(core, "first", tokens(1, 20), max_new_tokens=16)]
        for i in range(3):  # arrivals while the others decode, some over several chunks
            step(core)
            step(core)
            reqs.append(add(core, f"r{i}", tokens(40 + i, 30 + 40 * i), max_new_tokens=6))
        run_to_idle(core)
        trace = core.scheduler.stats.step_trace
        assert any(d and p for d, p in trace) == mixed, trace
        outputs[mixed] = [r.output_ids for r in reqs]
    assert outputs[True] == outputs[False]


# -- abort ----------------------------------------------------------------------------------

SHARED = tokens(10, 24)


def _victim_in_state(core: EngineCore, state: str) -> tuple[Req, Req]:
    """A companion request that shares a 24-token prefix with the victim, and the victim in
    ``state``; the companion is decoding (or waiting behind it, for 'retracted')."""
    companion = add(core, "companion", SHARED + tokens(11, 6), max_new_tokens=12)
    while companion.state != ReqState.DECODE:
        step(core)
    victim = add(core, "victim", SHARED + tokens(12, 40), max_new_tokens=30)
    target = {"prefill": ReqState.PREFILL, "decode": ReqState.DECODE}.get(state)
    if state == "retracted":
        while victim.num_retractions == 0:
            step(core)
        assert victim.state == ReqState.WAITING and victim.req_pool_idx is None
    elif target is not None:
        while victim.state != target:
            step(core)
        assert victim.req_pool_idx is not None
    return companion, victim


@pytest.mark.parametrize("state", ["waiting", "prefill", "decode", "retracted"])
def test_abort_in_every_state_frees_its_kv_and_unlocks_its_nodes(
    tiny_llama_dir: Path, state: str
) -> None:
    settings: dict[str, object] = {"chunked_prefill_size": 8}
    if state == "retracted":
        settings["max_total_tokens"] = 80  # both decoding overflow it; the newest is retracted
        settings["schedule_conservativeness"] = 0.0  # admission keeps no room back
    core = make_core(tiny_llama_dir, **settings)
    sched = core.scheduler
    companion, victim = _victim_in_state(core, state)
    if state == "prefill":
        assert 0 < victim.kv_len < len(victim.input_ids)
        assert victim.prefix_len == victim.kv_len  # its computed chunks are in the tree, locked
    locked_before = sched.cache.locked_size
    assert core.abort("victim") is victim
    assert victim.state == ReqState.ABORTED and victim.finish_reason is not None
    assert victim.finish_reason.type == "abort"
    assert victim.req_pool_idx is None and victim.cache_node is None
    assert victim not in sched.running and victim not in sched.waiting
    check_accounting(core)
    if state in ("prefill", "decode"):
        assert sched.cache.locked_size < locked_before  # its own nodes are unlocked
    assert core.abort("victim") is None  # already gone
    run_to_idle(core)
    assert sched.cache.locked_size == 0
    sched.check_no_leak()
    assert companion.finish_reason is not None and companion.finish_reason.type == "length"
    assert companion.output_ids == solo_output(tiny_llama_dir, companion.input_ids, 12)


def test_abort_of_the_only_request_leaves_the_pool_free_after_flush(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir, chunked_prefill_size=16)
    req = add(core, "r", tokens(20, 60))
    step(core)
    assert req.state == ReqState.PREFILL and core.scheduler.cache.locked_size == 16
    core.abort("r")
    assert not core.has_work()
    assert core.flush_cache()
    assert core.runner.allocator.available() == core.runner.kv_size


# -- KV pressure ----------------------------------------------------------------------------


def test_retraction_under_kv_pressure_keeps_greedy_outputs(tiny_llama_dir: Path) -> None:
    prompts = [SHARED[:16] + tokens(30 + i, 14) for i in range(6)]
    roomy = make_core(tiny_llama_dir)
    tight = make_core(
        tiny_llama_dir, max_total_tokens=96, chunked_prefill_size=32, schedule_conservativeness=0.0
    )
    results = []
    for core in (roomy, tight):
        reqs = [add(core, f"r{i}", p, max_new_tokens=20) for i, p in enumerate(prompts)]
        run_to_idle(core)
        assert all(r.finish_reason is not None and r.finish_reason.type == "length" for r in reqs)
        results.append([r.output_ids for r in reqs])
        core.scheduler.check_no_leak()
    assert roomy.scheduler.stats.retractions == 0
    assert tight.scheduler.stats.retractions > 0
    assert results[0] == results[1]


def test_retraction_counters_and_cached_tokens_of_retracted_requests(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir, max_total_tokens=64, schedule_conservativeness=0.0)
    reqs = [add(core, f"r{i}", tokens(40 + i, 20), max_new_tokens=16) for i in range(3)]
    run_to_idle(core)
    stats = core.scheduler.stats
    assert stats.retractions == sum(r.num_retractions for r in reqs) > 0
    # A retracted request's re-admission is not a cache hit of its prompt.
    assert all(r.cached_tokens == 0 for r in reqs)
    assert stats.prompt_tokens == 60 and stats.cached_tokens == 0


# -- admission order per policy --------------------------------------------------------------


def _warm(core: EngineCore, *prefixes: list[int]) -> None:
    """Cache each prefix (its request samples one token, so all of it is computed)."""
    for i, prefix in enumerate(prefixes):
        add(core, f"warm{i}", prefix, max_new_tokens=1)
        run_to_idle(core)


def test_lpm_admits_the_longest_prefix_match_first(tiny_llama_dir: Path) -> None:
    system = tokens(50, 32)
    core = make_core(tiny_llama_dir, schedule_policy="lpm", chunked_prefill_size=-1)
    _warm(core, system)
    add(core, "none", tokens(51, 20))
    add(core, "short", system[:8] + tokens(52, 12))
    add(core, "long", system[:28] + tokens(53, 12))
    add(core, "mid", system[:16] + tokens(54, 12))
    step(core)
    assert running_order(core) == ["long", "mid", "short", "none"]


def test_lpm_admits_the_best_match_first_when_only_one_fits(tiny_llama_dir: Path) -> None:
    system = tokens(50, 32)
    core = make_core(tiny_llama_dir, schedule_policy="lpm", max_running_requests=1)
    _warm(core, system)
    add(core, "none", tokens(51, 20))
    add(core, "long", system + tokens(53, 12))
    step(core)
    assert running_order(core) == ["long"]
    assert core.scheduler.running[0].cached_tokens == 32


def test_fcfs_keeps_arrival_order(tiny_llama_dir: Path) -> None:
    system = tokens(50, 32)
    core = make_core(tiny_llama_dir, schedule_policy="fcfs", chunked_prefill_size=-1)
    _warm(core, system)
    rids = ["none", "short", "long", "mid"]
    add(core, "none", tokens(51, 20))
    add(core, "short", system[:8] + tokens(52, 12))
    add(core, "long", system[:28] + tokens(53, 12))
    add(core, "mid", system[:16] + tokens(54, 12))
    step(core)
    assert running_order(core) == rids


def test_dfs_weight_groups_shared_prefixes_heaviest_first(tiny_llama_dir: Path) -> None:
    a, b = tokens(60, 24), tokens(61, 24)
    core = make_core(tiny_llama_dir, schedule_policy="dfs-weight", chunked_prefill_size=-1)
    _warm(core, a, b)
    arrivals = [("b1", b), ("a1", a), ("b2", b), ("a2", a), ("none", tokens(62, 4)), ("a3", a)]
    for i, (rid, prefix) in enumerate(arrivals):
        add(core, rid, prefix + tokens(70 + i, 6))
    step(core)
    # Unmatched requests sit at the root (visited first); then the heavier subtree.
    assert running_order(core) == ["none", "a1", "a2", "a3", "b1", "b2"]


def test_dfs_weight_breaks_ties_by_arrival(tiny_llama_dir: Path) -> None:
    a, b = tokens(60, 24), tokens(61, 24)
    core = make_core(tiny_llama_dir, schedule_policy="dfs-weight", chunked_prefill_size=-1)
    _warm(core, a, b)  # a's subtree was created first
    for i, (rid, prefix) in enumerate([("a1", a), ("b1", b), ("a2", a), ("b2", b)]):
        add(core, rid, prefix + tokens(80 + i, 6))
    step(core)
    assert running_order(core) == ["a1", "a2", "b1", "b2"]


def test_dfs_weight_without_the_radix_cache_keeps_arrival_order(tiny_llama_dir: Path) -> None:
    core = make_core(
        tiny_llama_dir,
        schedule_policy="dfs-weight",
        disable_radix_cache=True,
        chunked_prefill_size=-1,
    )
    rids = [f"r{i}" for i in range(5)]
    for i, rid in enumerate(rids):
        add(core, rid, tokens(90 + i, 10))
    step(core)
    assert running_order(core) == rids


def test_random_admits_a_shuffled_permutation(tiny_llama_dir: Path) -> None:
    rids = [f"r{i}" for i in range(8)]
    orders = []
    for seed in (0, 1):
        core = make_core(
            tiny_llama_dir, schedule_policy="random", random_seed=seed, chunked_prefill_size=-1
        )
        for i, rid in enumerate(rids):
            add(core, rid, tokens(100 + i, 10))
        step(core)
        orders.append(running_order(core))
        assert sorted(orders[-1]) == rids
    assert orders[0] != rids or orders[1] != rids
    assert orders[0] != orders[1]


# -- stats and flush ------------------------------------------------------------------------


def test_cache_hit_rate_counts_matched_prompt_tokens(tiny_llama_dir: Path) -> None:
    system = tokens(110, 30)
    core = make_core(tiny_llama_dir, chunked_prefill_size=-1)
    stats = core.scheduler.stats
    assert stats.cache_hit_rate == 0.0
    first = add(core, "first", system + tokens(111, 10))
    run_to_idle(core)
    second = add(core, "second", system + tokens(112, 10))
    run_to_idle(core)
    assert (first.cached_tokens, second.cached_tokens) == (0, 30)
    assert (stats.prompt_tokens, stats.cached_tokens) == (80, 30)
    assert stats.cache_hit_rate == pytest.approx(30 / 80)


def test_flush_cache_empties_the_tree_only_when_idle(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    sched = core.scheduler
    add(core, "a", tokens(120, 30))
    run_to_idle(core)
    cached = sched.cache.evictable_size
    assert cached > 0
    busy = add(core, "b", tokens(121, 30))
    assert core.flush_cache() is False  # refused while a request waits
    assert sched.cache.evictable_size == cached
    run_to_idle(core)
    assert busy.finished
    assert core.flush_cache() is True
    assert sched.cache.evictable_size == 0 and sched.cache.total_size() == 0
    assert core.runner.allocator.available() == core.runner.kv_size
    again = add(core, "c", tokens(120, 30))
    run_to_idle(core)
    assert again.cached_tokens == 0


def test_a_prompt_is_shared_as_soon_as_its_prefill_completes(tiny_llama_dir: Path) -> None:
    system = tokens(130, 40)
    core = make_core(tiny_llama_dir, chunked_prefill_size=-1)
    first = add(core, "first", system + tokens(131, 5), max_new_tokens=20)
    step(core)
    assert first.state == ReqState.DECODE
    second = add(core, "second", system + tokens(132, 5), max_new_tokens=20)
    step(core)
    assert second.cached_tokens == 40  # the first is still decoding
    assert core.scheduler.stats.step_trace[-1] == (1, 5)
    run_to_idle(core)
    assert second.output_ids == solo_output(tiny_llama_dir, second.input_ids, 20)
