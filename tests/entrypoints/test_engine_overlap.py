"""Overlap scheduling through the offline Engine: with the next step scheduled before the
previous step's tokens reach the host, every output (ids, text, finish reason, logprobs) is the
same as with synchronous steps, for a mix of greedy, seeded, stopped, penalised and logprob
requests, under chunked prefill and under KV pressure; nothing leaks.

The CPU runs steps synchronously, so overlap is forced on here with enable_overlap_schedule; the
scheduling logic is the same one the CUDA platform turns on by default."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine

LOW, HIGH = 3, 360  # ordinary token ids of the tiny model


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(LOW, HIGH) for _ in range(n)]


SHARED = tokens(0, 20)


def workload(stop_token: int) -> list[tuple[list[int], dict[str, Any], dict[str, Any]]]:
    """(input_ids, sampling_params, generate kwargs) for a mixed batch."""
    jobs: list[tuple[list[int], dict[str, Any], dict[str, Any]]] = []
    for i in range(10):  # greedy, shared prefix, lengths 1..28
        params = {"temperature": 0.0, "max_new_tokens": 1 + 3 * i, "ignore_eos": True}
        jobs.append((SHARED + tokens(100 + i, 3 + i), params, {}))
    for i in range(4):  # seeded sampling: positional seeds must not shift by a pending token
        params = {"temperature": 0.9, "top_p": 0.9, "seed": 7 + i, "max_new_tokens": 16}
        jobs.append((tokens(200 + i, 9), params, {}))
    stop = {"temperature": 0.0, "max_new_tokens": 24, "stop_token_ids": [stop_token]}
    jobs.append((SHARED + tokens(300, 5), stop, {}))  # stops early, one step late with overlap
    penalised = {"temperature": 0.0, "max_new_tokens": 12, "frequency_penalty": 0.5}
    jobs.append((tokens(301, 12), penalised, {}))  # not overlappable: forces a sync
    greedy = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    jobs.append((tokens(302, 15), greedy, {"return_logprob": True, "top_logprobs_num": 2}))
    jobs.append((tokens(303, 7), {"temperature": 0.0, "max_new_tokens": 0}, {}))
    jobs.append((tokens(304, 40), {"temperature": 0.0, "min_new_tokens": 6,
                                   "max_new_tokens": 9}, {}))  # fmt: skip
    return jobs


def run_all(engine: Engine, jobs: list[tuple[list[int], dict[str, Any], dict[str, Any]]]) -> list:
    """Submit every job at once (from threads) so they share steps; results in job order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(engine.generate, input_ids=ids, sampling_params=params, **kw)
            for ids, params, kw in jobs
        ]
        return [f.result(timeout=300) for f in futures]


def comparable(result: dict[str, Any]) -> tuple:
    meta = result["meta_info"]
    logprobs = meta.get("output_token_logprobs")
    if logprobs is not None:
        logprobs = [(round(lp, 4), tok) for lp, tok, *_ in logprobs]
    return (result["output_ids"], result["text"], meta["finish_reason"], logprobs)


@pytest.fixture(scope="module")
def stop_token(tiny_llama_dir: Path) -> int:
    """A token the stop job's greedy output produces at its 4th position."""
    with Engine(str(tiny_llama_dir), max_total_tokens=4096) as engine:
        out = engine.generate(
            input_ids=SHARED + tokens(300, 5),
            sampling_params={"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
        )
    assert len(out["output_ids"]) == 8
    return int(out["output_ids"][3])


@pytest.mark.parametrize(
    "settings",
    [
        {"chunked_prefill_size": 16, "max_running_requests": 6},
        # retractions under pressure (admission keeps no room back)
        {"chunked_prefill_size": 32, "max_total_tokens": 160, "schedule_conservativeness": 0.0},
    ],
    ids=["chunked", "kv-pressure"],
)
def test_overlap_gives_the_same_outputs_as_synchronous_steps(
    tiny_llama_dir: Path, stop_token: int, settings: dict[str, Any]
) -> None:
    settings = {"max_total_tokens": 4096, **settings}
    jobs = workload(stop_token)
    outputs = {}
    for mode in ("sync", "overlap"):
        # sync asks for it by name: a CUDA platform overlaps by default
        with Engine(
            str(tiny_llama_dir),
            enable_overlap_schedule=mode == "overlap",
            disable_overlap_schedule=mode == "sync",
            **settings,
        ) as engine:
            assert engine.core.overlap is (mode == "overlap")
            outputs[mode] = [comparable(r) for r in run_all(engine, jobs)]
            core = engine.core
            assert not core.has_work()
            core.scheduler.check_no_leak()
            if settings["max_total_tokens"] < 200:
                assert core.scheduler.stats.retractions > 0
    assert outputs["overlap"] == outputs["sync"]
    stop_result = outputs["overlap"][14]
    assert stop_result[2] == {"type": "stop", "matched": stop_token}
    assert len(stop_result[0]) < 24
    assert [len(o[0]) for o in outputs["overlap"][:10]] == [1 + 3 * i for i in range(10)]


def test_overlap_with_speculation_on_gives_the_same_outputs(
    tiny_llama_dir: Path, stop_token: int
) -> None:
    """With speculation on, decode-only steps still overlap (here: while more requests run than
    the speculation cut-off), and steps that draft wait for the step in flight: greedy outputs
    equal synchronous steps without speculation, over the switches between the two."""
    import radixserve_test_drafters as drafters

    from radixserve.core.plugins import PluginHost

    jobs = [job for job in workload(stop_token) if job[1].get("temperature") == 0.0]
    jobs = [job for job in jobs if not job[2]]  # logprobs: verify and decode round apart
    settings = {"max_total_tokens": 4096, "chunked_prefill_size": 16, "max_running_requests": 6}
    with Engine(str(tiny_llama_dir), **settings) as engine:
        reference = [comparable(r)[:3] for r in run_all(engine, jobs)]
    spec = {
        "speculative_algorithm": drafters.NAME,
        "speculative_disable_batch_size": 2,
        "speculative_num_steps": drafters.DRAFT_TOKENS,
        "speculative_disable_pause": True,
    }
    host = PluginHost(extra_plugins=[("test_drafters", drafters)])
    with Engine(
        str(tiny_llama_dir), host=host, enable_overlap_schedule=True, **settings, **spec
    ) as engine:  # fmt: skip
        assert engine.core.overlap
        outputs = [comparable(r)[:3] for r in run_all(engine, jobs)]
        core = engine.core
        stats = core.spec_stats()
        assert stats is not None and stats["verified_requests"] > 0, stats
        assert core.overlapped_steps > 0
        core.scheduler.check_no_leak()
    assert outputs == reference


def test_abort_while_a_step_is_in_flight_loses_nothing(tiny_llama_dir: Path) -> None:
    """Aborts arrive between steps, when the newest step is still in flight: the aborted
    request ends with 'abort', the others finish normally, and no KV leaks."""
    with Engine(str(tiny_llama_dir), max_total_tokens=4096, enable_overlap_schedule=True) as eng:
        params = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
        stream = eng.generate(input_ids=tokens(400, 10), sampling_params=params, stream=True)
        first = next(iter(stream))
        rid = first["meta_info"]["id"]
        short = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
        others = run_all(eng, [(tokens(401 + i, 8), short, {}) for i in range(3)])
        eng.abort(rid)
        last = [first, *stream][-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in others)
        assert all(len(o["output_ids"]) == 5 for o in others)
        deadline = time.monotonic() + 120  # only stops a hung test
        while eng.core.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine thread reports what the abort's sync committed
        assert not eng.core.has_work()
        eng.core.scheduler.check_no_leak()
