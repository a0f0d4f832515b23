"""A prefill server, a decode server and (optionally) the real sglang-router in PD mode in front
of them, all on loopback, for the disaggregation tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests
from server_process import RunningServer, free_port, start_server, stop_server, tiny_server_args

ROUTER_LAUNCHER = Path(__file__).with_name("sglang_router_launch.py")


@dataclass
class PDPair:
    prefill: RunningServer
    decode: RunningServer
    bootstrap_port: int

    def body(self, room: int, **fields: object) -> dict[str, object]:
        """``fields`` plus the bootstrap fields a PD router injects."""
        return {
            **fields,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": room,
        }


def pd_args(model_dir: Path, mode: str, backend: str, bootstrap_port: int) -> list[str]:
    return [
        *tiny_server_args(model_dir),
        "--disaggregation-mode", mode,
        "--disaggregation-transfer-backend", backend,
        "--disaggregation-bootstrap-port", str(bootstrap_port),
    ]  # fmt: skip


@contextlib.contextmanager
def pd_pair(
    model_dir: Path,
    logs: Path,
    backend: str = "tcp",
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[PDPair]:
    """A prefill and a decode server of ``model_dir`` (the tiny test model's flags, leak
    check on) joined by ``backend``, started and stopped side by side."""
    port = free_port()
    more = extra or []
    args = {
        "prefill": [*pd_args(model_dir, "prefill", backend, port), *more],
        "decode": [*pd_args(model_dir, "decode", backend, free_port()), *more],
    }
    with ThreadPoolExecutor(2) as pool:
        starting = {
            role: pool.submit(start_server, a, logs / f"{role}.log", env=env)
            for role, a in args.items()
        }
        started = {}
        for role, future in starting.items():
            with contextlib.suppress(Exception):
                started[role] = future.result()
        if len(started) < 2:
            list(pool.map(stop_server, started.values()))
            for future in starting.values():
                future.result()  # raises the start failure
    try:
        yield PDPair(started["prefill"], started["decode"], port)
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(stop_server, started.values()))


@dataclass
class Router:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path


@contextlib.contextmanager
def pd_router(pair: PDPair, log_path: Path, timeout: float = 60.0) -> Iterator[Router]:
    """sglang-router in PD mode (the launch command of ROUTER.md, through
    sglang_router_launch.py, which says why) in front of ``pair``."""
    port = free_port()
    cmd = [
        sys.executable, str(ROUTER_LAUNCHER),
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--pd-disaggregation",
        "--prefill", pair.prefill.url, str(pair.bootstrap_port),
        "--decode", pair.decode.url,
        "--policy", "round_robin", "--log-level", "warn",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    router = Router(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_ready(router, timeout)
        yield router
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def _wait_ready(router: Router, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"router exited: {router.log_path.read_text()[-3000:]}")
        with contextlib.suppress(requests.RequestException):
            workers = requests.get(router.url + "/workers", timeout=5).json()["workers"]
            if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                return
        time.sleep(0.25)
    raise RuntimeError(f"router not ready in {timeout} s: {router.log_path.read_text()[-3000:]}")


def kv_state(server: RunningServer, timeout: float = 30.0) -> dict[str, int]:
    """The engine's KV accounting once no request runs (waits for idle)."""
    deadline = time.monotonic() + timeout
    while True:
        info = requests.get(server.url + "/server_info", headers=server.headers, timeout=10).json()
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        if idle and info["num_live_requests"] == 0 or time.monotonic() > deadline:
            return info["kv"]
        time.sleep(0.1)
