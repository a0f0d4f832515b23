"""KV exhaustion: on a server whose KV pool holds 256 tokens, requests that together need many
times that are served in turn (retraction and queueing) or refused with 503, never a crash or a
hang; afterwards the pool is whole again."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hardening import assert_openai_error, own_server, wait_idle
from server_process import RunningServer

POOL = 256


@pytest.fixture(scope="module")
def small_pool(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("small-pool") / "server.log"
    flags = ["--max-total-tokens", str(POOL), "--max-running-requests", "8"]
    flags += ["--max-queued-requests", "6", "--chunked-prefill-size", "64"]
    with own_server(tiny_long_llama_dir, log, *flags) as running:
        yield running


def _ask(server: RunningServer, i: int, tokens: int) -> httpx.Response:
    body = {
        "text": f"request {i}: " + "word " * 40,
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }
    return httpx.post(server.url + "/generate", json=body, headers=server.headers, timeout=90)


def test_oversubscribed_pool_serves_in_turn_or_refuses(small_pool: RunningServer) -> None:
    with ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(lambda i: _ask(small_pool, i, 150), range(20)))
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(served) + len(refused) == 20, [(r.status_code, r.text[:200]) for r in responses]
    assert len(served) >= 8, [r.status_code for r in responses]  # more than the pool holds
    for r in served:
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 150
    for r in refused:
        assert_openai_error(r, range(503, 504))
        assert "Retry-After" in r.headers
    state = wait_idle(small_pool, timeout=10)
    assert state["kv"]["in_use"] == 0 and state["num_running_reqs"] == 0, state
    assert state["max_total_num_tokens"] <= POOL + 64, state


def test_a_request_larger_than_the_pool_is_refused_or_cut(small_pool: RunningServer) -> None:
    r = _ask(small_pool, 0, 2 * POOL)
    assert r.status_code in (200, 400, 503), r.text
    if r.status_code == 200:
        assert r.json()["meta_info"]["completion_tokens"] <= 2 * POOL
    else:
        assert_openai_error(r, range(400, 504))
    assert small_pool.proc.poll() is None, small_pool.log()[-3000:]
    assert httpx.get(small_pool.url + "/health", timeout=10).status_code == 200
    state = wait_idle(small_pool, timeout=10)
    assert state["kv"]["in_use"] == 0, state
