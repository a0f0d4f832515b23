"""Issue 13, the engine's second line: a request that makes sampling raise although it passed
validation ends alone, with an abort naming the error, and the requests sampled with it in the
same batch go on as if it had never been there."""

from __future__ import annotations

from pathlib import Path

import pytest
from platform_choice import CPU

from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, SamplingParams


def make_core(model_dir: Path) -> EngineCore:
    config = EngineConfig(max_total_tokens=4096, debug_leak_check=True, plugins=(CPU,))
    return EngineCore(model_dir, config, default_host())


def run(core: EngineCore, *reqs: Req, break_after_add: Req | None = None) -> None:
    for req in reqs:
        core.add_request(req)
    if break_after_add is not None:
        break_after_add.sampling.temperature = "hot"  # type: ignore[assignment]  # never valid
    for _ in range(1000):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("no progress")


def seeded(rid: str, seed: int, **kw: object) -> Req:
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed, ignore_eos=True, **kw)
    return Req(rid, [5, 6, 7, 8], params)  # type: ignore[arg-type]


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "with logprobs"])
def test_a_request_whose_sampling_raises_ends_alone(tiny_llama_dir: Path, logprobs: bool) -> None:
    core = make_core(tiny_llama_dir)
    alone = seeded("alone", 11, logprobs=logprobs)
    run(core, alone)
    good, bad = seeded("good", 11, logprobs=logprobs), seeded("bad", 12, logprobs=logprobs)
    run(core, good, bad, break_after_add=bad)
    assert good.finish_reason is not None and good.finish_reason.type == "length"
    assert good.output_ids == alone.output_ids  # as if the bad one had never been there
    assert bad.finish_reason is not None and bad.finish_reason.type == "abort"
    assert bad.failed and "sampling failed for this request (TypeError" in bad.failed
    assert bad.finish_reason.message == bad.failed
    core.scheduler.check_no_leak()
    core.shutdown()


def test_a_lone_request_whose_sampling_raises_ends_and_the_engine_goes_on(
    tiny_llama_dir: Path,
) -> None:
    core = make_core(tiny_llama_dir)
    bad = seeded("bad", 3)
    run(core, bad, break_after_add=bad)
    assert bad.finish_reason is not None and bad.finish_reason.type == "abort"
    assert bad.failed and "the engine failed on this request's step" in bad.failed
    after = seeded("after", 4)
    run(core, after)
    assert len(after.output_ids) == 8
    core.scheduler.check_no_leak()
    core.shutdown()
