"""Issue 13 on a real server: one request cannot take the engine's time, memory or life.

- Grammars: a JSON schema with 5,000 required integer properties and a recursive required
  schema answer 400 with the reason, within --grammar-compile-timeout; a compile that runs past
  the timeout, or past --grammar-compile-memory, is stopped in its sandbox process and answered
  400. Meanwhile another client's requests are served (its latency is printed) and the engine's
  memory does not grow with the attack.
- A request that makes the engine raise (a model plugin that fails on one token) ends with a
  500 naming the error; the engine lives and serves the next request, with nothing leaked.

The server loads the test plugin ``radixserve_test_faults`` (FaultyLlama, grammar ``runaway``:
xgrammar plus two runaway regexes) through its entry point, so the engine process and the
grammar sandbox find it the real way.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from hardening import Background, assert_openai_error, is_idle, own_server, wait_idle
from model_gate import install_plugin
from radixserve_test_faults import FAULT_TOKEN, GROW_SPEC, SLEEP_SPEC
from server_process import TINY_MODEL_NAME, RunningServer

COMPILE_TIMEOUT_S = 10.0
COMPILE_MEMORY_MB = 256
HANG_GUARD_S = 120.0

pytestmark = pytest.mark.slow  # its own server

MANY_REQUIRED = {
    "type": "object",
    "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
    "required": [f"p{i}" for i in range(5000)],
}
RECURSIVE_REQUIRED = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}


@pytest.fixture(scope="module")
def isolated(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("isolation")
    env = install_plugin(tmp / "site", "radixserve_test_faults")
    flags = ["--plugin", "model=FaultyLlama", "--plugin", "grammar=runaway"]
    flags += ["--grammar-compile-timeout", str(COMPILE_TIMEOUT_S)]
    flags += ["--grammar-compile-memory", str(COMPILE_MEMORY_MB)]
    with own_server(tiny_long_llama_dir, tmp / "server.log", *flags, env=env) as running:
        # The first grammar starts the sandbox process (not counted against the timeout).
        warm = _native(running, {"regex": "[0-9]{3}", "max_new_tokens": 4})
        assert warm.status_code == 200, warm.text
        yield running


class OtherClient(Background):
    """Another client sending small requests the whole time; records each latency."""

    def __init__(self, server: RunningServer) -> None:
        super().__init__()
        self.server = server
        self.latencies: list[float] = []
        self.statuses: list[int] = []

    def run(self, stop: threading.Event) -> None:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        with httpx.Client(headers=self.server.headers, timeout=HANG_GUARD_S) as client:
            while not stop.is_set():
                start = time.monotonic()
                r = client.post(self.server.url + "/generate", json=body)
                self.latencies.append(time.monotonic() - start)
                self.statuses.append(r.status_code)

    def report(self, label: str) -> str:
        lat = sorted(self.latencies)
        p50, top = statistics.median(lat), lat[-1]
        return f"{label}: other client {len(lat)} requests, p50 {p50:.3f} s, max {top:.3f} s"

    def assert_served(self) -> None:
        assert self.statuses and set(self.statuses) == {200}, self.statuses


class EngineMemory(Background):
    """Peak resident memory of the engine process (not its sandbox children) while in use."""

    def __init__(self, server: RunningServer) -> None:
        super().__init__()
        children = psutil.Process(server.proc.pid).children()
        engines = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(engines) == 1, [c.cmdline() for c in children]
        self.engine = engines[0]
        self.before = self.peak = self.engine.memory_info().rss

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(0.05):
            self.peak = max(self.peak, self.engine.memory_info().rss)

    def report(self) -> str:
        mib = 1 << 20
        return f"engine RSS {self.before / mib:.0f} MiB before, peak {self.peak / mib:.0f} MiB"


def _native(server: RunningServer, sampling: dict[str, Any]) -> httpx.Response:
    body = {"text": "hello", "sampling_params": sampling}
    url = server.url + "/generate"
    return httpx.post(url, json=body, headers=server.headers, timeout=HANG_GUARD_S)


def _chat(server: RunningServer, schema: dict[str, Any], max_tokens: int) -> httpx.Response:
    body = {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": "JSON please"}],
        "max_tokens": max_tokens,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    url = server.url + "/v1/chat/completions"
    return httpx.post(url, json=body, headers=server.headers, timeout=HANG_GUARD_S)


def _refused_in_time(make: Any, *needles: str) -> float:
    start = time.monotonic()
    r = make()
    elapsed = time.monotonic() - start
    assert_openai_error(r, range(400, 401))
    message = r.json()["error"]["message"]
    for needle in needles:
        assert needle in message, message
    assert elapsed < COMPILE_TIMEOUT_S + 5, (elapsed, message)  # a hang guard, with slack
    return elapsed


ATTACKS: list[tuple[str, Any, tuple[str, ...]]] = [
    (
        "5,000 required properties (native)",
        lambda s: _native(s, {"json_schema": json.dumps(MANY_REQUIRED)}),
        ("every output json_schema allows is at least", "max_new_tokens is 128"),
    ),
    (
        "5,000 required properties (chat response_format)",
        lambda s: _chat(s, MANY_REQUIRED, 256),
        ("every output json_schema allows is at least", "max_new_tokens is 256"),
    ),
    (
        "recursive required schema (native, max_new_tokens 8)",
        lambda s: _native(s, {"json_schema": json.dumps(RECURSIVE_REQUIRED), "max_new_tokens": 8}),
        ("can never finish", "required property"),
    ),
    (
        "recursive required schema (chat response_format)",
        lambda s: _chat(s, RECURSIVE_REQUIRED, 8),
        ("can never finish",),
    ),
    (
        "a compile that runs past the timeout",
        lambda s: _native(s, {"regex": SLEEP_SPEC, "max_new_tokens": 8}),
        (f"did not compile within grammar_compile_timeout={COMPILE_TIMEOUT_S:g}s",),
    ),
    (
        "a compile that runs past the memory limit",
        lambda s: _native(s, {"regex": GROW_SPEC, "max_new_tokens": 8}),
        (f"{COMPILE_MEMORY_MB} MiB", "--grammar-compile-memory"),
    ),
]


@pytest.mark.parametrize(("name", "make", "needles"), ATTACKS, ids=[a[0] for a in ATTACKS])
def test_grammar_attack_is_400_in_time_while_others_are_served(
    isolated: RunningServer, name: str, make: Any, needles: tuple[str, ...]
) -> None:
    with EngineMemory(isolated) as memory, OtherClient(isolated) as other:
        elapsed = _refused_in_time(lambda: make(isolated), *needles)
        time.sleep(0.5)  # let the other client finish a request after the refusal, too
    other.assert_served()
    print(f"\n{name}: 400 after {elapsed:.2f} s; {other.report('meanwhile')}; {memory.report()}")
    # The engine never ran the runaway: its memory stays put (the sandbox's is capped).
    assert memory.peak - memory.before < COMPILE_MEMORY_MB << 20, memory.report()
    assert is_idle(wait_idle(isolated, timeout=30))
    assert isolated.proc.poll() is None


def test_the_same_runaway_twice_at_once_is_refused_for_both(isolated: RunningServer) -> None:
    """Two requests sharing one runaway compile both get the 400; the sandbox is replaced."""
    results: list[httpx.Response] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(_native(isolated, {"regex": SLEEP_SPEC})), daemon=True
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert len(results) == 2
    for r in results:
        assert_openai_error(r, range(400, 401))
    ok = _native(isolated, {"regex": "(yes|no)", "max_new_tokens": 4})
    assert ok.status_code == 200 and ok.json()["text"] in ("yes", "no"), ok.text


@pytest.fixture(scope="module")
def isolated_tp2(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The faulty model with tensor parallelism: every rank's forward raises on the bad step."""
    tmp = tmp_path_factory.mktemp("isolation-tp2")
    env = install_plugin(tmp / "site", "radixserve_test_faults")
    flags = ["--plugin", "model=FaultyLlama", "--tp-size", "2"]
    with own_server(tiny_long_llama_dir, tmp / "server.log", *flags, env=env) as running:
        yield running


@pytest.mark.parametrize("tp", [1, 2])
def test_request_that_raises_in_the_engine_is_500_and_the_engine_goes_on(
    request: pytest.FixtureRequest, tp: int
) -> None:
    """Also with --tp-size 2, where the other rank's forward raised too and ended that rank:
    the server went down with it."""
    isolated: RunningServer = request.getfixturevalue("isolated" if tp == 1 else "isolated_tp2")
    body = {"input_ids": [5, FAULT_TOKEN, 7], "sampling_params": {"max_new_tokens": 4}}
    url = isolated.url + "/generate"
    for _ in range(5):  # more than any count of failures in a row the engine would tolerate
        r = httpx.post(url, json=body, headers=isolated.headers, timeout=HANG_GUARD_S)
        assert_openai_error(r, range(500, 501))
        message = r.json()["error"]["message"]
        assert "the engine failed on this request's step" in message, message
        assert f"test fault: the prompt holds token {FAULT_TOKEN}" in message, message
    health = httpx.get(isolated.url + "/health_generate", headers=isolated.headers, timeout=60)
    assert health.status_code == 200, health.text
    ok = _native(isolated, {"max_new_tokens": 4, "ignore_eos": True})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4, ok.text
    state = wait_idle(isolated, timeout=30)
    assert is_idle(state), state
    assert isolated.proc.poll() is None
