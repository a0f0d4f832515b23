"""Crash detection and graceful shutdown on real servers: kill -9 of the engine under load makes
/health answer 503, fails in-flight requests and exits non-zero; a stalled step trips the
watchdog; SIGTERM drains (in-flight requests finish, new ones are refused) and exits 0, and
requests still running at --shutdown-timeout end with an abort.

"In flight" never depends on how fast the machine generates: the servers run the test model
plugin (tests/support/radixserve_test_models.py), whose GatedLlama holds a request inside its
model step until the test opens the gate, and whose StallingLlama never returns from one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from hardening import generate, own_server
from model_gate import STALL_TOKEN, Gate, gated_prompt, install_test_models
from server_process import RunningServer

HANG_GUARD_S = 120  # only stops a hung test; no outcome depends on it


def _engine_pid(server: RunningServer) -> int:
    children = psutil.Process(server.proc.pid).children(recursive=True)
    engines = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert len(engines) == 1, [c.cmdline() for c in children]
    return engines[0].pid


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def _in_background(server: RunningServer, body: dict[str, Any], out: list[Any]) -> None:
    def run() -> None:
        url = server.url + "/generate"
        try:
            out.append(httpx.post(url, json=body, headers=server.headers, timeout=HANG_GUARD_S))
        except httpx.HTTPError as e:
            out.append(f"{type(e).__name__}: {e}")

    threading.Thread(target=run, daemon=True).start()


def _gated_batch(count: int, tokens: int) -> dict[str, Any]:
    """One /generate call of ``count`` gated prompts: admitted together, in flight together."""
    prompts = [gated_prompt(5, 6 + i) for i in range(count)]
    return {"input_ids": prompts, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}


def _wait_for(predicate, timeout: float = HANG_GUARD_S) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@contextmanager
def _gated_server(
    model_dir: Path, tmp_path: Path, *flags: str
) -> Iterator[tuple[RunningServer, Gate]]:
    gate = Gate(tmp_path / "gate")
    env = {**install_test_models(tmp_path / "site"), **gate.env}
    flags = ("--plugin", "model=GatedLlama", *flags)
    gate.close()
    try:
        with own_server(model_dir, tmp_path / "server.log", *flags, env=env) as server:
            yield server, gate
    finally:
        gate.open()


def _health(server: RunningServer, seen: list[int]) -> int | None:
    try:
        seen.append(httpx.get(server.url + "/health", timeout=10).status_code)
    except httpx.TransportError:
        return None
    return seen[-1]


def _refuses_new_requests(server: RunningServer) -> bool:
    """True once a new request is refused: the listener is closed, or a 503 while draining."""
    try:
        r = httpx.get(server.url + "/v1/models", headers=server.headers, timeout=10)
    except httpx.TransportError:
        return True
    return r.status_code == 503


def _open_and_exit_zero(server: RunningServer, gate: Gate, results: list[Any]) -> Any:
    """Let the held step end: the draining server exits 0 and the in-flight call is answered
    200; return its outputs."""
    gate.open()
    assert server.proc.wait(HANG_GUARD_S) == 0, server.log()[-3000:]
    assert _wait_for(lambda: len(results) == 1), results
    r = results[0]
    assert not isinstance(r, str) and r.status_code == 200, r
    return r.json()


def test_kill_engine_under_load(tiny_long_llama_dir: Path, tmp_path: Path) -> None:
    with _gated_server(tiny_long_llama_dir, tmp_path) as (server, gate):
        results: list[httpx.Response | str] = []
        _in_background(server, _gated_batch(4, 2000), results)
        gate.wait_entered()  # all four are in flight
        engine_pid = _engine_pid(server)
        os.kill(engine_pid, signal.SIGKILL)
        # Health probes notice the engine as soon as it can be reaped (all of its threads have
        # ended), not at the receive loop's next poll; how soon that is depends on the machine.
        statuses: list[int] = []
        assert _wait_for(lambda: _health(server, statuses) == 503), statuses
        try:  # once dead, never healthy again (the server may already be on its way out)
            again = httpx.get(server.url + "/health_generate", headers=server.headers, timeout=10)
            assert again.status_code == 503, again.text
        except httpx.TransportError:
            pass
        assert server.proc.wait(HANG_GUARD_S) != 0, server.log()[-2000:]
        assert _wait_for(lambda: len(results) == 1), results
        r = results[0]  # the in-flight requests ended with an error, none completed normally
        assert isinstance(r, str) or r.status_code >= 500, r


def test_sigterm_drains_and_exits_zero(tiny_long_llama_dir: Path, tmp_path: Path) -> None:
    """SIGTERM while requests are inside a model step: new requests are refused at once, the
    in-flight ones finish normally once their step returns, and the server exits 0."""
    flags = ("--shutdown-timeout", "600")  # far past the test: nothing is aborted
    with _gated_server(tiny_long_llama_dir, tmp_path, *flags) as (server, gate):
        results: list[httpx.Response | str] = []
        _in_background(server, _gated_batch(2, 16), results)
        gate.wait_entered()
        server.proc.send_signal(signal.SIGTERM)
        assert _wait_for(lambda: _refuses_new_requests(server)), server.log()[-3000:]
        with pytest.raises(httpx.TransportError):  # refused: nothing new reaches the engine
            generate(server, 4, timeout=10)
        assert not results  # still held at the gate
        for out in _open_and_exit_zero(server, gate, results):
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}, out
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=2)


def test_sigterm_aborts_what_runs_past_the_shutdown_timeout(
    tiny_long_llama_dir: Path, tmp_path: Path
) -> None:
    """Requests still inside a model step at --shutdown-timeout are aborted (and answered with
    an abort naming the timeout), and the server still exits 0."""
    with _gated_server(tiny_long_llama_dir, tmp_path, "--shutdown-timeout", "1") as (server, gate):
        results: list[httpx.Response | str] = []
        _in_background(server, _gated_batch(2, 2000), results)
        gate.wait_entered()
        server.proc.send_signal(signal.SIGTERM)
        passed = "--shutdown-timeout=1s passed; aborted 2 in-flight requests"
        assert _wait_for(lambda: passed in server.log()), server.log()[-3000:]
        for out in _open_and_exit_zero(server, gate, results):
            reason = out["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "--shutdown-timeout=1s" in reason["message"], out
            assert out["meta_info"]["completion_tokens"] < 2000


WATCHDOG_SCRIPT = textwrap.dedent(
    """
    import time, types, zmq
    from radixserve.entrypoints.engine_process import EngineLoop

    class StuckCore:
        config = types.SimpleNamespace(watchdog_timeout=0.5, disaggregation_mode="null")
        strategies: list = []  # no step strategies (not a prefill or decode server)
        def has_work(self): return True
        def idle_wait(self): return None
        def step(self): time.sleep(3600); return []

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://in"); push.bind("inproc://out")
    EngineLoop(StuckCore(), pull, push).run()
    """
)


def test_watchdog_ends_a_stalled_engine() -> None:
    from radixserve.entrypoints.engine_process import WATCHDOG_EXIT_CODE

    # The exit code alone shows the watchdog ended it: the stuck step never returns by itself.
    proc = subprocess.run(
        [sys.executable, "-c", WATCHDOG_SCRIPT],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == WATCHDOG_EXIT_CODE, proc.stderr[-2000:]
    assert "stalled" in proc.stderr


def test_watchdog_ends_a_real_stalled_model_step(tiny_long_llama_dir: Path, tmp_path: Path) -> None:
    """A model step that hangs inside the model's forward, on a real server: the watchdog ends
    the engine, /health turns 503, the stalled request gets an error, the server exits 1."""
    from radixserve.entrypoints.engine_process import WATCHDOG_EXIT_CODE

    env = install_test_models(tmp_path / "site")
    args = ("--plugin", "model=StallingLlama", "--watchdog-timeout", "2")
    with own_server(tiny_long_llama_dir, tmp_path / "server.log", *args, env=env) as server:
        assert generate(server, 4).status_code == 200  # the plugin serves normal prompts
        engine_pid = _engine_pid(server)
        body = {"input_ids": [5, STALL_TOKEN, 7], "sampling_params": {"max_new_tokens": 4}}
        stalled = httpx.post(
            server.url + "/generate", json=body, headers=server.headers, timeout=HANG_GUARD_S
        )
        assert stalled.status_code >= 500, stalled.text
        assert _is_gone(engine_pid)
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503, health.text
        assert server.proc.wait(HANG_GUARD_S) == 1, server.log()[-2000:]
        log = server.log()
        assert "stalled" in log and str(WATCHDOG_EXIT_CODE) in log, log[-3000:]
