"""Helpers of the hardening tests: OpenAI error checks, idle polling and a background stream of
valid requests that must stay untouched while the server is being abused."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
from server_process import (
    TINY_API_KEY,
    TINY_MODEL_NAME,
    RunningServer,
    start_server,
    stop_server,
    tiny_server_args,
)

VALID_CHAT = {
    "model": TINY_MODEL_NAME,
    "messages": [{"role": "user", "content": "Hello there"}],
    "max_tokens": 8,
    "temperature": 0.0,
    "ignore_eos": True,
}


def assert_openai_error(response: httpx.Response, statuses: range = range(400, 500)) -> None:
    """The response is an error with a status in ``statuses`` and an OpenAI error object."""
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert "param" in error and "code" in error, body


def server_state(server: RunningServer, client: httpx.Client | None = None) -> dict[str, Any]:
    get = (client or httpx).get  # type: ignore[attr-defined]
    response = get(server.url + "/get_server_info", headers=server.headers, timeout=10)
    response.raise_for_status()
    return response.json()  # type: ignore[no-any-return]


def metric(server: RunningServer, name: str, **labels: str) -> float:
    """One sample of /metrics (0.0 when the labelled series does not exist yet)."""
    text = httpx.get(server.url + "/metrics", timeout=60).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_idle(server: RunningServer, timeout: float) -> dict[str, Any]:
    """Poll /get_server_info until nothing runs or waits, no KV is in use and the server holds
    no live request; return the state (the caller asserts on it, so a timeout shows the last
    state seen)."""
    return wait_state(server, is_idle, timeout)


def wait_state(
    server: RunningServer, done: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    """Poll /get_server_info until ``done(state)`` or ``timeout`` s; return the last state."""
    deadline = time.monotonic() + timeout
    while True:
        state = server_state(server)
        if done(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid``, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def send_raw_generate(server: RunningServer, body: dict[str, Any]) -> socket.socket:
    """Send a /generate on a socket of its own and return the socket, unread."""
    data = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: a reset, as a client that crashed or timed out sends."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def is_idle(state: dict[str, Any]) -> bool:
    """The leak invariant at idle: nothing running or waiting, no KV in use or locked, and no
    live request left in the server's bookkeeping (each would hold an admission slot)."""
    return (
        state["num_running_reqs"] == 0
        and state["num_waiting_reqs"] == 0
        and state["kv"]["in_use"] == 0
        and state["kv"]["locked"] == 0
        and state["num_live_requests"] == 0
    )


_B = TypeVar("_B", bound="Background")


class Background:
    """A daemon thread that runs ``run(stop)`` for the length of a ``with`` block; ``run`` must
    return soon after the ``stop`` event is set."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, args=(self._stop,), daemon=True)

    def run(self, stop: threading.Event) -> None:
        raise NotImplementedError

    def __enter__(self: _B) -> _B:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), f"{type(self).__name__}: the thread hung"


class ValidTraffic:
    """A thread that sends valid chat requests until stopped and records every outcome."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.results: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ValidTraffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "the valid-traffic thread hung"

    def _run(self) -> None:
        with httpx.Client(headers=self.server.headers, timeout=60) as client:
            while not self._stop.is_set():
                r = client.post(self.server.url + "/v1/chat/completions", json=VALID_CHAT)
                reason = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None
                self.results.append((r.status_code, reason))

    def assert_untouched(self, at_least: int = 1) -> None:
        assert len(self.results) >= at_least, self.results
        assert all(s == 200 and f == "length" for s, f in self.results), self.results


@contextlib.contextmanager
def own_server(
    model_dir: Path, log: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[RunningServer]:
    """A private tiny-model server with extra flags (and environment); stopped (SIGTERM, then
    SIGKILL) after."""
    running = start_server([*tiny_server_args(model_dir), *extra], log, TINY_API_KEY, env=env)
    try:
        yield running
    finally:
        stop_server(running)


def generate(server: RunningServer, tokens: int, timeout: float = 60, **kw: Any) -> httpx.Response:
    sampling = {"max_new_tokens": tokens, "ignore_eos": True, **kw}
    body = {"text": "hello", "sampling_params": sampling}
    return httpx.post(server.url + "/generate", json=body, headers=server.headers, timeout=timeout)
