"""The malformed-input battery against the real server: 13 kinds x 10 variants, every one a 4xx
in the OpenAI error format, while a parallel stream of valid requests completes untouched and
the KV leak invariant holds afterwards (the server runs with --debug-leak-check)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from hardening import ValidTraffic, assert_openai_error, is_idle, wait_idle
from malformed_cases import CASES
from server_process import RunningServer


@pytest.fixture(scope="module")
def traffic(server: RunningServer) -> Iterator[ValidTraffic]:
    with ValidTraffic(server) as t:
        yield t


@pytest.mark.parametrize("kind", sorted(CASES))
def test_malformed_kind_is_refused(kind: str, server: RunningServer, traffic: ValidTraffic) -> None:
    assert len(CASES[kind]) >= 10
    headers = {**server.headers, "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        failures = []
        for i, (path, body) in enumerate(CASES[kind]):
            response = client.post(path, content=body)
            try:
                assert_openai_error(response)
            except AssertionError as e:
                failures.append(f"{kind}[{i}] {path} {body[:100]!r}: {e}")
    assert not failures, "\n".join(failures)


def test_valid_traffic_untouched_and_no_leak(server: RunningServer, traffic: ValidTraffic) -> None:
    traffic.__exit__(None, None, None)
    traffic.assert_untouched(at_least=3)
    state = wait_idle(server, timeout=10)
    assert is_idle(state), state
    assert server.proc.poll() is None, server.log()[-2000:]
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200
