"""A disconnect storm: 128 streaming clients that hang up at random points. Afterwards every
request is gone from the engine and its KV freed, and the leak invariant holds (the shared
server runs with --debug-leak-check, which would kill it on a leak). How fast the server gets
there depends on the machine, so no wall time is asserted (bench/ measures speed)."""

from __future__ import annotations

import random
import threading

import httpx
from hardening import metric, server_state, wait_idle
from server_process import RunningServer

CLIENTS = 128
HANG_GUARD_S = 120  # only stops a hung test; no outcome depends on it


def _client(server: RunningServer, seed: int, closed: list[int], errors: list[str]) -> None:
    rng = random.Random(seed)
    events_before_hangup = rng.choice([0, 0, 1, 2, 5, 10, 20, 40])
    body = {
        "text": f"storm client {seed} " * rng.randint(1, 30),
        "sampling_params": {"max_new_tokens": rng.randint(50, 1500), "ignore_eos": True},
        "stream": True,
    }
    try:
        with httpx.Client(headers=server.headers, timeout=60) as client:
            with client.stream("POST", server.url + "/generate", json=body) as response:
                if response.status_code != 200:
                    errors.append(f"client {seed}: status {response.status_code}")
                    return
                seen = 0
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        seen += 1
                        if seen >= events_before_hangup:
                            break
    except httpx.HTTPError as e:
        errors.append(f"client {seed}: {type(e).__name__}: {e}")
    finally:
        closed.append(seed)


def test_disconnect_storm_frees_all_kv(any_server: RunningServer) -> None:
    server = any_server
    aborted_before = metric(server, "sglang:num_aborted_requests_total")
    closed: list[int] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=_client, args=(server, i, closed, errors), daemon=True)
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert not any(t.is_alive() for t in threads), "a storm client hung"
    assert not errors, errors[:5]
    assert len(closed) == CLIENTS
    state = wait_idle(server, timeout=HANG_GUARD_S)
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0, state
    assert state["kv"]["in_use"] == 0, state
    assert state["num_live_requests"] == 0, state
    # Hang-ups abort their requests: had the server let every one run to its max_new_tokens
    # (up to 1,500 tokens after the first event), none would have ended with an abort.
    assert metric(server, "sglang:num_aborted_requests_total") > aborted_before
    # The engine idled with --debug-leak-check: a leak would have killed it.
    assert server.proc.poll() is None, server.log()[-3000:]
    ok = server_state(server)
    assert ok["kv"]["in_use"] == 0
    ok_gen = httpx.post(
        server.url + "/generate",
        json={"text": "after the storm", "sampling_params": {"max_new_tokens": 4}},
        headers=server.headers,
        timeout=30,
    )
    assert ok_gen.status_code == 200, ok_gen.text
