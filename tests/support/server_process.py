"""Run the real server (``python -m radixserve.launch_server``) as a subprocess for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from platform_choice import CPU_FLAGS

READY_LINE = "radixserve ready at "

# The shared tiny-model test server (tests/entrypoints/conftest.py) and what tests know of it.
TINY_API_KEY = "sk-radixserve-test"
TINY_MODEL_NAME = "tiny-llama"
TINY_CONTEXT = 2048
TINY_MAX_BODY_BYTES = 1 << 20


def tiny_server_args(model_dir: Path) -> list[str]:
    # the CPU platform by name: on a GPU machine the tiny server's tests (outputs against
    # transformers on the CPU, --tp-size 2 on one host) would otherwise run on CUDA
    return [
        *CPU_FLAGS,
        "--model-path", str(model_dir),
        "--served-model-name", TINY_MODEL_NAME,
        "--enable-metrics",
        "--max-total-tokens", "16384",
        "--max-body-bytes", str(TINY_MAX_BODY_BYTES),
        "--debug-leak-check",
    ]  # fmt: skip


@dataclass
class RunningServer:
    url: str
    api_key: str | None
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    args: list[str],
    log_path: Path,
    api_key: str | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> RunningServer:
    """Start a server on a free loopback port and wait (up to ``timeout`` s) for its ready line.
    ``env`` adds to (or overrides) the inherited environment. A port taken between choosing it
    and the server's bind (parallel test workers choose too) is chosen again."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _start_server(args, log_path, api_key, timeout, env)
        except PortTaken:
            continue
    return _start_server(args, log_path, api_key, timeout, env)


PORT_ATTEMPTS = 5


class PortTaken(RuntimeError):
    """The chosen port was bound by someone else first."""


def _start_server(
    args: list[str],
    log_path: Path,
    api_key: str | None,
    timeout: float,
    env: dict[str, str] | None,
) -> RunningServer:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    # One intra-op thread: the test machine's 2 cores are shared, and OpenMP spinning under
    # oversubscription makes every step many times slower.
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = RunningServer(f"http://127.0.0.1:{port}", api_key, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if READY_LINE in server.log():
            return server
        if proc.poll() is not None:
            log = server.log()
            if "address already in use" in log:
                raise PortTaken(f"port {port} was taken before the server bound it")
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log[-4000:]}")
        time.sleep(0.25)
    stop_server(server)
    raise RuntimeError(f"server not ready within {timeout:.0f} s:\n{server.log()[-4000:]}")


def stop_server(server: RunningServer, timeout: float = 30.0) -> int | None:
    """SIGTERM (graceful: the server stops its engine process), then SIGKILL if needed."""
    proc = server.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode


def stream_in_background(
    url: str, text: str, max_new_tokens: int, timeout: float
) -> tuple[threading.Thread, list[str], threading.Event]:
    """Stream ``/generate`` of ``text`` (EOS ignored) from a daemon thread: the thread, the
    lines received, and an event set at the first line and when the stream ends (an HTTP error
    is appended as a line). For tests that kill a server part while a request is in flight."""
    lines: list[str] = []
    started = threading.Event()

    def generate() -> None:
        params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
        body = {"text": text, "stream": True, "sampling_params": params}
        try:
            with httpx.stream("POST", url + "/generate", json=body, timeout=timeout) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
        except httpx.HTTPError as e:
            lines.append(f"{type(e).__name__}: {e}")
        started.set()

    client = threading.Thread(target=generate, daemon=True)
    client.start()
    return client, lines, started
