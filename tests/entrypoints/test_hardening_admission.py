"""Admission control on a real server with tight limits: a full queue answers 503 with
Retry-After, --request-timeout ends a request with finish_reason abort, oversized headers are
refused, and every limit is documented in --help.

The server runs GatedLlama (tests/support/radixserve_test_models.py): a request whose prompt
ends in the gate token stays inside its model step until the test opens the gate, so "still
running" never depends on how fast the machine generates."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import httpx
import pytest
from hardening import assert_openai_error, own_server, server_state, wait_idle
from model_gate import Gate, gated_prompt, install_test_models
from server_process import RunningServer

from radixserve.entrypoints.server_args import build_parser

LIMIT_FLAGS = (
    "--max-queued-requests", "--request-timeout", "--max-n", "--max-stop-strings",
    "--max-stop-length", "--max-body-bytes", "--max-header-bytes", "--watchdog-timeout",
    "--shutdown-timeout", "--plugin-allow",
)  # fmt: skip
TIMEOUT_S = 2.0
HANG_GUARD_S = 120  # only stops a hung test; no outcome depends on it


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Gate:
    return Gate(tmp_path_factory.mktemp("gate"))


@pytest.fixture(scope="module")
def tight(
    tiny_long_llama_dir: Path, gate: Gate, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("tight")
    env = {**install_test_models(tmp / "site"), **gate.env}
    flags = ["--plugin", "model=GatedLlama"]
    flags += ["--max-running-requests", "2", "--max-queued-requests", "2"]
    flags += ["--request-timeout", str(TIMEOUT_S), "--max-header-bytes", "8192"]
    with own_server(tiny_long_llama_dir, tmp / "server.log", *flags, env=env) as running:
        yield running
    gate.open()


def gated_generate(server: RunningServer, tokens: int, **body: Any) -> httpx.Response:
    sampling = {"max_new_tokens": tokens, "ignore_eos": True}
    payload = {"input_ids": gated_prompt(), "sampling_params": sampling, **body}
    url = server.url + "/generate"
    return httpx.post(url, json=payload, headers=server.headers, timeout=HANG_GUARD_S)


def test_full_queue_answers_503_with_retry_after(tight: RunningServer, gate: Gate) -> None:
    """Two running plus two queued fill the server; with them held at the gate, exactly the
    other four of eight concurrent requests are refused."""
    gate.close()
    with ThreadPoolExecutor(8) as pool:
        try:
            futures = [pool.submit(gated_generate, tight, 8) for _ in range(8)]
            done = as_completed(futures, timeout=HANG_GUARD_S)
            first = [next(done) for _ in range(4)]  # the four held at the gate cannot finish
            held = [f for f in futures if f not in first]
            assert not any(f.done() for f in held)
            for f in first:
                assert_openai_error(f.result(), range(503, 504))
                assert int(f.result().headers["Retry-After"]) >= 1
        finally:
            gate.open()
        served = [f.result() for f in held]
    assert [r.status_code for r in served] == [200] * 4, [r.text[:200] for r in served]
    state = wait_idle(tight, timeout=HANG_GUARD_S)
    assert state["kv"]["in_use"] == 0 and state["num_running_reqs"] == 0, state


def test_request_timeout_ends_with_abort(tight: RunningServer, gate: Gate) -> None:
    """A request still inside a model step at --request-timeout ends with an abort naming the
    timeout once the step returns, and its KV is freed."""
    rid = "held-past-the-timeout"
    timed_out = re.compile(rf"request {rid} ran past --request-timeout")
    gate.close()
    with ThreadPoolExecutor(1) as pool:
        try:
            start = time.monotonic()
            future = pool.submit(gated_generate, tight, 2000, rid=rid)
            deadline = start + HANG_GUARD_S
            while not timed_out.search(tight.log()):
                assert time.monotonic() < deadline, tight.log()[-3000:]
                time.sleep(0.05)
            assert time.monotonic() - start >= TIMEOUT_S  # the timer never fires early
            assert not future.done()  # held at the gate: the timeout came first, by design
        finally:
            gate.open()
        r = future.result()
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == {
        "type": "abort",
        "message": f"the request ran past --request-timeout={TIMEOUT_S:g}s",
    }, meta
    assert meta["completion_tokens"] < 2000
    state = wait_idle(tight, timeout=HANG_GUARD_S)
    assert state["kv"]["in_use"] == 0 and state["num_running_reqs"] == 0, state


def test_oversized_headers_are_refused(tight: RunningServer) -> None:
    headers = {**tight.headers, "X-Padding": "p" * 20_000}
    r = httpx.get(tight.url + "/v1/models", headers=headers, timeout=10)
    assert r.status_code in (400, 431), r.status_code
    ok = httpx.get(tight.url + "/v1/models", headers=tight.headers, timeout=10)
    assert ok.status_code == 200


def test_server_info_reports_kv_accounting_and_limits(tight: RunningServer) -> None:
    info = server_state(tight)
    assert set(info["kv"]) >= {"free", "evictable", "locked", "in_use", "size"}
    assert info["max_queued_requests"] == 2 and info["request_timeout"] == TIMEOUT_S
    assert info["draining"] is False


def test_every_limit_is_documented_in_help() -> None:
    text = build_parser().format_help()
    for flag in LIMIT_FLAGS:
        assert flag in text, flag
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings}
    for flag in LIMIT_FLAGS:
        assert helps[flag] and len(helps[flag]) > 15, (flag, helps[flag])
