"""Admission control on a real server with tight limits: a full queue answers 503 with
Retry-After, --request-timeout ends a request with finish_reason abort, oversized headers are
refused, and every limit is documented in --help."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hardening import assert_openai_error, generate, own_server, server_state, wait_idle
from server_process import RunningServer

from radixserve.entrypoints.server_args import build_parser

LIMIT_FLAGS = (
    "--max-queued-requests", "--request-timeout", "--max-n", "--max-stop-strings",
    "--max-stop-length", "--max-body-bytes", "--max-header-bytes", "--watchdog-timeout",
    "--shutdown-timeout", "--plugin-allow",
)  # fmt: skip
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def tight(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("tight") / "server.log"
    flags = ["--max-running-requests", "2", "--max-queued-requests", "2"]
    flags += ["--request-timeout", str(TIMEOUT_S), "--max-header-bytes", "8192"]
    with own_server(tiny_long_llama_dir, log, *flags) as running:
        yield running


def test_full_queue_answers_503_with_retry_after(tight: RunningServer) -> None:
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: generate(tight, 2000, timeout=60), range(8)))
    refused = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert len(served) + len(refused) == 8, [r.text[:200] for r in responses]
    assert 2 <= len(served) <= 4 and len(refused) >= 4, [r.status_code for r in responses]
    for r in refused:
        assert_openai_error(r, range(503, 504))
        assert int(r.headers["Retry-After"]) >= 1
    state = wait_idle(tight, timeout=10)
    assert state["kv"]["in_use"] == 0 and state["num_running_reqs"] == 0, state


def test_request_timeout_ends_with_abort(tight: RunningServer) -> None:
    start = time.monotonic()
    r = generate(tight, 2000, timeout=30)
    elapsed = time.monotonic() - start
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    assert meta["completion_tokens"] < 2000
    assert TIMEOUT_S - 0.5 < elapsed < TIMEOUT_S + 5, elapsed


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
