"""Crash detection and graceful shutdown on real servers: kill -9 of the engine under load makes
/health answer 503 within 5 s, fails in-flight requests and exits non-zero; a stalled step trips
the watchdog; SIGTERM drains (finishing or aborting in-flight requests) and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from hardening import generate, own_server
from server_process import RunningServer


def _engine_pid(server: RunningServer) -> int:
    children = psutil.Process(server.proc.pid).children(recursive=True)
    engines = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert len(engines) == 1, [c.cmdline() for c in children]
    return engines[0].pid


def _in_background(server: RunningServer, tokens: int, out: list[httpx.Response | str]) -> None:
    def run() -> None:
        try:
            out.append(generate(server, tokens, timeout=60))
        except httpx.HTTPError as e:
            out.append(f"{type(e).__name__}: {e}")

    threading.Thread(target=run, daemon=True).start()


def _wait_for(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_kill_engine_under_load(tiny_long_llama_dir: Path, tmp_path: Path) -> None:
    with own_server(tiny_long_llama_dir, tmp_path / "server.log") as server:
        results: list[httpx.Response | str] = []
        for _ in range(4):
            _in_background(server, 2000, results)
        time.sleep(1.0)
        os.kill(_engine_pid(server), signal.SIGKILL)
        killed = time.monotonic()
        statuses: list[int] = []

        def health_is_503() -> bool:
            try:
                statuses.append(httpx.get(server.url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                return False
            return statuses[-1] == 503

        assert _wait_for(health_is_503, 5.0), statuses
        assert time.monotonic() - killed < 5.0
        again = httpx.get(server.url + "/health_generate", headers=server.headers, timeout=5)
        assert again.status_code == 503, again.text  # once dead, never healthy again
        assert server.proc.wait(20) != 0, server.log()[-2000:]
        assert _wait_for(lambda: len(results) == 4, 10), results
        for r in results:  # in-flight requests ended with an error, none completed normally
            assert isinstance(r, str) or r.status_code >= 500, r


def test_sigterm_drains_and_exits_zero(tiny_long_llama_dir: Path, tmp_path: Path) -> None:
    with own_server(
        tiny_long_llama_dir, tmp_path / "server.log", "--shutdown-timeout", "2"
    ) as server:
        short: list[httpx.Response | str] = []
        long: list[httpx.Response | str] = []
        _in_background(server, 2000, long)
        _in_background(server, 2000, long)
        _in_background(server, 30, short)
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(20) == 0, server.log()[-3000:]
        assert _wait_for(lambda: len(short) == 1 and len(long) == 2, 10), (short, long)
        first = short[0]
        assert not isinstance(first, str) and first.status_code == 200, first
        assert first.json()["meta_info"]["finish_reason"]["type"] == "length"
        for r in long:  # still running at the deadline: aborted, but answered
            assert not isinstance(r, str) and r.status_code == 200, r
            assert r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.json()
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=2)


WATCHDOG_SCRIPT = textwrap.dedent(
    """
    import time, types, zmq
    from radixserve.entrypoints.engine_process import EngineLoop

    class StuckCore:
        config = types.SimpleNamespace(watchdog_timeout=0.5)
        def has_work(self): return True
        def step(self): time.sleep(30); return []

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://in"); push.bind("inproc://out")
    EngineLoop(StuckCore(), pull, push).run()
    """
)


def test_watchdog_ends_a_stalled_engine() -> None:
    from radixserve.entrypoints.engine_process import WATCHDOG_EXIT_CODE

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", WATCHDOG_SCRIPT], capture_output=True, text=True, timeout=20
    )
    assert proc.returncode == WATCHDOG_EXIT_CODE, proc.stderr[-2000:]
    assert "stalled" in proc.stderr
    assert time.monotonic() - start < 15


STALL_TOKEN = 357  # a prompt holding this token id makes the stalling model's forward hang

STALLING_PLUGIN = textwrap.dedent(
    f"""
    import time

    import radixserve
    from radixserve.plugins.models.llama import LlamaForCausalLM


    class StallingLlama(LlamaForCausalLM):
        def forward(self, batch):
            if bool((batch.input_ids == {STALL_TOKEN}).any()):
                time.sleep(3600)  # a model step that never returns (a hung kernel, a deadlock)
            return super().forward(batch)


    @radixserve.hookimpl
    def register_models(register):
        register("StallingLlama", StallingLlama, description="test: hangs on token {STALL_TOKEN}")
    """
)


def _install_stalling_plugin(site: Path) -> None:
    """A third-party model plugin, found through its entry point like any installed one."""
    site.mkdir()
    (site / "stalling_plugin.py").write_text(STALLING_PLUGIN)
    info = site / "stalling_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: stalling-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[radixserve]\nstalling = stalling_plugin\n")


def test_watchdog_ends_a_real_stalled_model_step(
    tiny_long_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model step that hangs inside the model's forward, on a real server: the watchdog ends
    the engine, /health turns 503, the stalled request gets an error, the server exits 1."""
    from radixserve.entrypoints.engine_process import WATCHDOG_EXIT_CODE

    site = tmp_path / "site"
    _install_stalling_plugin(site)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    args = ("--plugin", "model=StallingLlama", "--watchdog-timeout", "2")
    with own_server(tiny_long_llama_dir, tmp_path / "server.log", *args) as server:
        assert generate(server, 4).status_code == 200  # the plugin serves normal prompts
        engine_pid = _engine_pid(server)
        body = {"input_ids": [5, STALL_TOKEN, 7], "sampling_params": {"max_new_tokens": 4}}
        stalled = httpx.post(
            server.url + "/generate", json=body, headers=server.headers, timeout=60
        )
        assert stalled.status_code >= 500, stalled.text
        assert not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() in (
            psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD,
        )  # fmt: skip
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503, health.text
        assert server.proc.wait(20) == 1, server.log()[-2000:]
        log = server.log()
        assert "stalled" in log and str(WATCHDOG_EXIT_CODE) in log, log[-3000:]
