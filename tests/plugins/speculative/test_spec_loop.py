"""The device-side speculative loop (core/spec_loop.py, plugins/speculative/head_cycle.py) on
the CPU, where ``enable_speculative_loop`` turns it on (CUDA has it by default):

- SmolLM2 with the shipped eagle3 and eagle heads: greedy outputs, texts and finish reasons
  equal speculation off at batch 1 and 4, with identical prompts sent together, repeated
  prompts (prefix reuse), stop strings, stop tokens and budgets that end mid-cycle; the loop
  really ran and accepted drafts; no KV leaked.
- The tiny Llama with a random EAGLE-3 head, driven step by step: an arrival and an abort
  each stop the loop, which resumes afterwards; nothing is lost and the slots held ahead come
  back. A sampled, logprobs or min-tokens request keeps it off (it speculates from the host).
  A small paged pool (retraction, slots ahead that cannot be had) changes no output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from random_heads import write_random_eagle3_head
from scheduler_checks import check_accounting, greedy
from small_pool_speculation import run_small_pool

from radixserve import Engine
from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, SamplingParams
from radixserve.core.spec_strategy import loop_of, speculator_of

LOOP = {
    "enable_speculative_loop": True,
    "speculative_disable_pause": True,  # every step drafts: the loop never pauses
    "speculative_disable_batch_size": 8,
}


def _prompts(engine: Engine) -> list[tuple[list[int], dict[str, Any]]]:
    def chat(text: str) -> list[int]:
        return engine.tokenizer.encode_chat([{"role": "user", "content": text}])

    base = {"temperature": 0, "max_new_tokens": 40}
    json_prompt = chat("Give a JSON object with keys name, age and city for a made-up person.")
    return [
        (chat("Write one sentence about the sea."), base),
        (json_prompt, base),
        (json_prompt, base),  # identical, sent together
        (chat("Write a Python function that reverses a string."), base | {"max_new_tokens": 7}),
        (chat("Describe a red fox to a child."), base | {"stop": [" fox", "."]}),
        (chat("Count from one to twenty in words."), base | {"stop_token_ids": [28]}),
        (json_prompt, base | {"max_new_tokens": 23}),  # repeated: its prefix is cached
    ]


def _run(engine: Engine) -> list[dict[str, Any]]:
    prompts = _prompts(engine)
    out = [engine.generate(input_ids=ids, sampling_params=p) for ids, p in prompts[:3]]
    batch = prompts[3:]  # four at once
    out += engine.generate(input_ids=[i for i, _ in batch], sampling_params=[p for _, p in batch])
    return out


def _smollm2(path: Path, **kw: Any) -> Engine:
    kw.setdefault("max_total_tokens", 8192)  # the default pool takes a share of the host memory
    return Engine(str(path), dtype="float32", debug_leak_check=True, **kw)


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> list[dict[str, Any]]:
    with _smollm2(smollm2_dir) as engine:
        return _run(engine)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_loop_outputs_equal_speculation_off(
    smollm2_dir: Path, reference: list[dict[str, Any]], algorithm: str
) -> None:
    with _smollm2(smollm2_dir, speculative_algorithm=algorithm, **LOOP) as engine:
        out = _run(engine)
        # (no reference to the loop kept past the engine: it holds the model and KV pool)
        assert loop_of(engine.core) is not None
        assert loop_of(engine.core).cycles > 20 and loop_of(engine.core).loops >= 4
        stats = engine.core.spec_stats()
        assert stats is not None and stats["accepted_tokens"] > 20
        engine.core.scheduler.check_no_leak()
    for want, got in zip(reference, out, strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        # each verify emits its accepted drafts plus one token, the prefill one: a cycle cut
        # by a stop or the budget counts only the drafts it kept
        meta = got["meta_info"]
        verified = meta["spec_verify_ct"] + meta["spec_accepted_tokens"]
        assert verified <= meta["completion_tokens"] - 1, meta
    reasons = {str(o["meta_info"]["finish_reason"]["type"]) for o in out}
    assert {"stop", "length"} <= reasons


@pytest.mark.slow
def test_loop_with_pauses_and_warmed_catch_up_outputs_equal_speculation_off(
    smollm2_dir: Path, reference: list[dict[str, Any]]
) -> None:
    """The policy's pauses on (the loop judges its requests as one and pauses them together;
    on the CPU a cycle costs more than on a GPU, so the loop stops and restarts), after the
    start-up warm-up of every catch-up mix, which leaves no row taken and no KV written that a
    request reads."""
    flags = LOOP | {"speculative_disable_pause": False}
    with _smollm2(smollm2_dir, speculative_algorithm="EAGLE3", **flags) as engine:
        rows = engine.core.scheduler.req_to_token.available()
        speculator_of(engine.core).algorithm.warm_catch_up(4)
        assert engine.core.scheduler.req_to_token.available() == rows
        out = _run(engine)
        loop = loop_of(engine.core)
        assert loop is not None and loop.cycles > 0
        engine.core.scheduler.check_no_leak()
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in reference]
    assert [o["text"] for o in out] == [o["text"] for o in reference]


# -- the tiny Llama, a random head, step by step --------------------------------------------

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_eagle3_head(tiny_llama_dir, tmp_path_factory.mktemp("loop-head"), [0, 1, 1])


def _core(model_dir: Path, head: Path | None, **kw: Any) -> EngineCore:
    spec = {} if head is None else {"speculative_algorithm": "EAGLE3", **LOOP}
    if head is not None:
        spec["speculative_draft_model_path"] = str(head)
    config = EngineConfig(max_total_tokens=2048, debug_leak_check=True, **spec, **kw)
    return EngineCore(model_dir, config, default_host())


def _drain(core: EngineCore, steps: int = 400) -> None:
    for _ in range(steps):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("the core did not drain")


def _reference(model_dir: Path, prompts: dict[str, list[int]], tokens: int) -> dict[str, list[int]]:
    core = _core(model_dir, None)
    reqs = {rid: Req(rid, list(p), greedy(tokens)) for rid, p in prompts.items()}
    for req in reqs.values():
        core.add_request(req)
    _drain(core)
    return {rid: r.output_ids for rid, r in reqs.items()}


def _step_until(core: EngineCore, looping: bool, limit: int = 50) -> None:
    loop = loop_of(core)
    assert loop is not None
    for _ in range(limit):
        core.step()
        if loop.active == looping:
            return
    raise AssertionError(f"the loop never became {'active' if looping else 'inactive'}")


def test_arrival_and_abort_stop_the_loop_and_lose_nothing(
    tiny_llama_dir: Path, head_dir: Path
) -> None:
    prompts = {"a": PROMPT, "b": PROMPT[::-1], "c": [20, 21, 22, 23, 24, 25]}
    want = _reference(tiny_llama_dir, prompts, 60)
    core = _core(tiny_llama_dir, head_dir)
    loop = loop_of(core)
    assert loop is not None
    reqs = {rid: Req(rid, list(p), greedy(60)) for rid, p in prompts.items()}
    core.add_request(reqs["a"])
    core.add_request(reqs["b"])
    _step_until(core, looping=True)
    # Slots are held ahead of each request while it loops.
    acct = core.scheduler.kv_accounting()
    assert acct["in_use"] > sum(r.kv_len for r in core.scheduler.running)
    core.add_request(reqs["c"])  # an arrival stops the loop; the scheduler admits it
    _step_until(core, looping=False)
    check_accounting(core)
    assert reqs["c"] in core.scheduler.running
    _step_until(core, looping=True)  # all three decode: the loop takes them again
    assert len(loop.reqs) == 3
    aborted = core.abort("b")
    assert aborted is reqs["b"] and reqs["b"].finished
    assert not loop.active
    check_accounting(core)
    _drain(core)
    core.scheduler.check_no_leak()
    assert loop.loops >= 3 and loop.cycles > 10
    for rid in ("a", "c"):
        assert reqs[rid].output_ids == want[rid]
    b = reqs["b"].output_ids
    assert 0 < len(b) < 60 and b == want["b"][: len(b)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=30, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=0.0, logprobs=True, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=0.0, min_new_tokens=30),
    ],
    ids=["sampled", "logprobs", "min-tokens"],
)
def test_requests_that_need_the_host_keep_the_loop_off(
    tiny_llama_dir: Path, head_dir: Path, params: SamplingParams
) -> None:
    core = _core(tiny_llama_dir, head_dir)
    req = Req("other", list(PROMPT), params)
    core.add_request(req)
    _drain(core)
    assert loop_of(core) is not None and loop_of(core).loops == 0
    assert len(req.output_ids) == 30 and core.spec_stats()["verify_steps"] > 0
    core.scheduler.check_no_leak()


def test_small_pool_outputs_equal_speculation_off(tiny_llama_dir: Path, head_dir: Path) -> None:
    want, _, _ = run_small_pool(tiny_llama_dir)
    got, retractions, stats = run_small_pool(
        tiny_llama_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(head_dir),
        enable_speculative_loop=True,
        speculative_disable_pause=True,
    )
    assert got == want
    assert retractions > 0 and stats["verify_steps"] > 0


def test_a_third_party_cycle_runs_the_loop(tiny_llama_dir: Path) -> None:
    """docs/plugins.md's worked example (tests/support/repeat_cycle.py), in process."""
    from repeat_cycle import RepeatPlugin

    from radixserve.core.plugins import PluginHost

    prompts = {"a": [7] * 12, "b": PROMPT, "c": [9, 9, 9, 9, 8, 9, 9, 9]}
    want = _reference(tiny_llama_dir, prompts, 48)
    host = PluginHost(extra_plugins=[("repeat", RepeatPlugin())])
    config = EngineConfig(
        max_total_tokens=2048, debug_leak_check=True, speculative_algorithm="repeat", **LOOP
    )
    core = EngineCore(tiny_llama_dir, config, host)
    reqs = {rid: Req(rid, list(p), greedy(48)) for rid, p in prompts.items()}
    for req in reqs.values():
        core.add_request(req)
    _drain(core)
    core.scheduler.check_no_leak()
    assert loop_of(core) is not None and loop_of(core).cycles > 10
    assert {rid: r.output_ids for rid, r in reqs.items()} == want
    stats = core.spec_stats()
    assert stats is not None and stats["accepted_tokens"] > 0
