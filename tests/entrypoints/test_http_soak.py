"""Soak (issue 4): 32 concurrent streaming clients for 30 s against the shared tiny server, and
at the same time 32 more against the same server with overlap scheduling (each server gets its
own 32 clients for the whole 30 s; the two soaks share the wall time instead of running one after
the other).

Every request completes with exactly ``max_new_tokens`` tokens and a ``[DONE]`` line, no client
sees an error, and afterwards nothing runs and no KV token is held (the server also runs with
``--debug-leak-check``, so a leak fails its exit in the session fixture). Clients stop issuing
requests after the soak time; every network wait and the final join are bounded.

``RADIXSERVE_SOAK_SECONDS`` shortens or lengthens the soak (default 30).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from server_process import TINY_MODEL_NAME, RunningServer

pytestmark = pytest.mark.slow

CLIENTS = 32
SOAK_S = float(os.environ.get("RADIXSERVE_SOAK_SECONDS", "30"))
MAX_NEW_TOKENS = 8
REQUEST_TIMEOUT = (10, 120)  # (connect, read between bytes) seconds
JOIN_GRACE_S = 240  # past the soak time: the last requests, queued behind 31 others, finish
IDLE_TIMEOUT_S = 60


@dataclass
class ClientLog:
    done: int = 0
    errors: list[str] = field(default_factory=list)


def _events(response: requests.Response) -> list[str]:
    return [line.decode() for line in response.iter_lines() if line]


def _check_stream(kind: str, status: int, events: list[str]) -> str | None:
    """None when the stream is complete and right, else what is wrong with it."""
    if status != 200:
        return f"{kind}: HTTP {status}: {' '.join(events)[:300]}"
    if len(events) < 2 or events[-1] != "data: [DONE]":
        return f"{kind}: stream did not end with [DONE]: {events[-3:]}"
    try:
        last = json.loads(events[-2].removeprefix("data: "))
    except ValueError:
        return f"{kind}: last chunk is not JSON: {events[-2][:300]}"
    if "error" in last:
        return f"{kind}: error chunk: {last['error']}"
    if kind == "generate":
        got = last["meta_info"]["completion_tokens"]
        reason = last["meta_info"]["finish_reason"]["type"]
    else:
        got = (last.get("usage") or {}).get("completion_tokens")
        finals = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        reasons = [c["choices"][0]["finish_reason"] for c in finals if c.get("choices")]
        reason = next((r for r in reversed(reasons) if r), None)
    if got != MAX_NEW_TOKENS:
        return f"{kind}: completion_tokens {got} != {MAX_NEW_TOKENS}"
    if reason != "length":
        return f"{kind}: finish_reason {reason!r} != 'length'"
    return None


def _one_request(server: RunningServer, client: int, i: int) -> str | None:
    if client % 4 == 3:  # a quarter of the clients use the OpenAI completions stream
        kind, path = "completions", "/v1/completions"
        body: dict[str, Any] = {
            "model": TINY_MODEL_NAME,
            "prompt": f"Client {client} request {i}:",
            "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0.7,
            "seed": client * 100_000 + i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    else:
        kind, path = "generate", "/generate"
        body = {
            "text": f"Client {client} request {i}:",
            "stream": True,
            "sampling_params": {
                "max_new_tokens": MAX_NEW_TOKENS,
                "temperature": 0.7,
                "seed": client * 100_000 + i,
                "ignore_eos": True,
            },
        }
    with requests.post(
        server.url + path, json=body, headers=server.headers, stream=True, timeout=REQUEST_TIMEOUT
    ) as r:
        return _check_stream(kind, r.status_code, _events(r))


def _client(server: RunningServer, client: int, deadline: float, log: ClientLog) -> None:
    i = 0
    while time.monotonic() < deadline:
        try:
            problem = _one_request(server, client, i)
        except Exception as e:  # noqa: BLE001 - every failure is recorded and asserted on
            problem = f"client {client} request {i}: {type(e).__name__}: {e}"
        if problem is None:
            log.done += 1
        else:
            log.errors.append(problem)
        i += 1


def _server_info(server: RunningServer) -> dict[str, Any]:
    r = requests.get(server.url + "/get_server_info", headers=server.headers, timeout=30)
    r.raise_for_status()
    return r.json()


def _wait_idle(server: RunningServer, name: str) -> None:
    end = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        info = _server_info(server)
        if info["num_running_reqs"] == 0 and info["kv"]["in_use"] == 0:
            return
        assert time.monotonic() < end, f"{name}: server not idle after {IDLE_TIMEOUT_S} s: {info}"
        time.sleep(0.2)


def test_32_streaming_clients_for_30s(server: RunningServer, overlap_server: RunningServer) -> None:
    servers = {"sync": server, "overlap": overlap_server}
    logs = {name: [ClientLog() for _ in range(CLIENTS)] for name in servers}
    deadline = time.monotonic() + SOAK_S
    threads = {
        name: [
            threading.Thread(target=_client, args=(srv, c, deadline, logs[name][c]), daemon=True)
            for c in range(CLIENTS)
        ]
        for name, srv in servers.items()
    }
    for name in servers:
        for t in threads[name]:
            t.start()
    join_until = deadline + JOIN_GRACE_S
    for name in servers:
        for t in threads[name]:
            t.join(max(0.0, join_until - time.monotonic()))
    for name, srv in servers.items():
        stuck = [c for c, t in enumerate(threads[name]) if t.is_alive()]
        assert not stuck, f"{name}: clients still running {JOIN_GRACE_S} s after the soak: {stuck}"

        errors = [e for log in logs[name] for e in log.errors]
        assert not errors, f"{name}: {len(errors)} failed requests, first: {errors[:5]}"
        assert all(log.done >= 1 for log in logs[name]), [log.done for log in logs[name]]

        _wait_idle(srv, name)
        done = sum(log.done for log in logs[name])
        print(f"soak {name}: {done} requests in {SOAK_S:.0f} s, 0 errors")
