"""Admission: the queue is ordered by a read-only prefix match (the tree changes only on
admission and insert); identical prompts and n>1 siblings sent together share one prefill;
admission keeps room for running requests' future tokens, so pressure retracts less."""

from __future__ import annotations

from pathlib import Path

from platform_choice import CPU, on_cpu
from scheduler_checks import greedy, run_to_idle, tokens

from radixserve import Engine
from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.plugins import default_host
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import Req, ReqState


def make_core(model_dir: Path, **settings: object) -> EngineCore:
    settings.setdefault("max_total_tokens", 4096)
    core = EngineCore(model_dir, EngineConfig(**on_cpu(settings)), default_host())
    core.scheduler.trace_steps = True
    return core


def tree_snapshot(cache: RadixCache) -> list[tuple[tuple[int, ...], int, int]]:
    return sorted((tuple(n.key), n.last_access, n.lock_ref) for n in cache._all_nodes())


def test_ordering_the_queue_never_changes_the_tree(tiny_llama_dir: Path) -> None:
    system = tokens(50, 32)
    core = make_core(tiny_llama_dir, schedule_policy="lpm", max_running_requests=1)
    warm = Req("warm", system, greedy(1))
    core.add_request(warm)
    run_to_idle(core)
    runner = Req("runner", tokens(51, 10), greedy(50))
    core.add_request(runner)
    core.step()
    assert runner.state == ReqState.DECODE
    for i, cut in enumerate([5, 12, 20, 27]):  # matches that end inside the cached node
        core.add_request(Req(f"w{i}", system[:cut] + tokens(60 + i, 8), greedy(4)))
    before = tree_snapshot(core.cache)
    for _ in range(3):  # lpm orders the four every step; none can be admitted
        core.step()
        assert [r.rid for r in core.scheduler.running] == ["runner"]
    assert tree_snapshot(core.cache) == before
    run_to_idle(core)


def test_identical_prompts_sent_together_share_one_prefill(tiny_llama_dir: Path) -> None:
    prompt = tokens(70, 40)
    results = {}
    for name in ("together", "alone"):
        core = make_core(tiny_llama_dir)
        copies = 4 if name == "together" else 1
        reqs = [Req(f"c{i}", list(prompt), greedy(6)) for i in range(copies)]
        for req in reqs:
            core.add_request(req)
        run_to_idle(core)
        prefill_tokens = sum(n for _, n in core.scheduler.stats.step_trace)
        results[name] = (prefill_tokens, [r.output_ids for r in reqs])
    together, alone = results["together"], results["alone"]
    # The first copy computes the prompt; each other copy only its last token, from the cache.
    assert together[0] == alone[0] + 3
    assert together[1] == alone[1] * 4


def test_n_choices_share_one_prefill(tiny_llama_dir: Path) -> None:
    prompt = tokens(71, 30)
    with Engine(str(tiny_llama_dir), plugins=[CPU], max_total_tokens=4096) as engine:
        out = engine.generate(
            input_ids=prompt,
            sampling_params={"temperature": 0.0, "max_new_tokens": 4, "n": 4},
        )
    cached = sorted(r["meta_info"]["cached_tokens"] for r in out)
    assert cached == [0, 29, 29, 29]
    assert len({tuple(r["output_ids"]) for r in out}) == 1


def test_admission_reserve_retracts_less_with_the_same_outputs(tiny_llama_dir: Path) -> None:
    shared = tokens(80, 16)
    prompts = [shared + tokens(81 + i, 14) for i in range(6)]
    retractions, outputs = {}, {}
    for conservativeness in (0.0, 1.0):
        core = make_core(
            tiny_llama_dir,
            max_total_tokens=112,
            chunked_prefill_size=32,
            schedule_conservativeness=conservativeness,
        )
        reqs = [Req(f"r{i}", p, greedy(20)) for i, p in enumerate(prompts)]
        for req in reqs:
            core.add_request(req)
        run_to_idle(core)
        retractions[conservativeness] = core.scheduler.stats.retractions
        outputs[conservativeness] = [r.output_ids for r in reqs]
    assert retractions[0.0] > 0
    assert retractions[1.0] < retractions[0.0], retractions
    assert outputs[1.0] == outputs[0.0]
