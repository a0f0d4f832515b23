"""EngineCore's weight update in process: while admission is paused the running request finishes
and a new one waits (it is neither run nor failed); after the reload it runs on the new weights
and nothing leaks."""

from __future__ import annotations

from pathlib import Path

import pytest
from platform_choice import CPU
from scheduler_checks import check_accounting, greedy
from tiny_models import make_tiny_llama_dir

from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, ReqState

PROMPT = [5, 6, 7, 8, 9, 10]


def make_core(model_dir: Path) -> EngineCore:
    config = EngineConfig(max_total_tokens=2048, debug_leak_check=True, plugins=(CPU,))
    return EngineCore(model_dir, config, default_host())


def run(core: EngineCore, req: Req) -> list[int]:
    core.add_request(req)
    while core.has_work():
        core.step()
    return req.output_ids


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("core-weights")
    return make_tiny_llama_dir(tmp / "a", seed=0), make_tiny_llama_dir(tmp / "b", seed=1)


def test_paused_core_drains_then_runs_waiting_requests_on_new_weights(
    dirs: tuple[Path, Path],
) -> None:
    a, b = dirs
    want_b = run(make_core(b), Req("ref", list(PROMPT), greedy(8)))
    core = make_core(a)
    want_a = run(core, Req("ref", list(PROMPT), greedy(8)))
    assert want_a != want_b
    first = Req("first", list(PROMPT), greedy(8))
    core.add_request(first)
    core.step()
    core.pause_admission(True)
    later = Req("later", list(PROMPT), greedy(8))
    core.add_request(later)
    steps = 0
    while not core.drained():
        core.step()
        check_accounting(core)
        steps += 1
        assert steps < 100
    assert first.output_ids == want_a  # finished on the old weights
    assert later.state == ReqState.WAITING and not later.output_ids
    core.step()  # a paused core with only waiting requests neither runs nor fails them
    assert later.state == ReqState.WAITING and later.finish_reason is None
    ok, message = core.update_weights(str(b))
    assert ok, message
    core.pause_admission(False)
    while core.has_work():
        core.step()
    assert later.output_ids == want_b
    core.scheduler.check_no_leak()


def test_failed_reload_keeps_the_old_weights(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = dirs
    core = make_core(a)
    want = run(core, Req("ref", list(PROMPT), greedy(8)))
    ok, message = core.update_weights(str(tmp_path / "nowhere"))
    assert not ok and "nowhere" in message
    assert run(core, Req("again", list(PROMPT), greedy(8))) == want
