"""An adversarial soak: valid chat traffic runs while a probe thread keeps sending what must not
hurt the server (deep JSON only Python's parser takes, multi-megabyte prompts, non-streaming and
streaming clients that drop their connections, a bad weights path, profile output outside the
profile directory, aborts of unknown requests). Every valid request succeeds, every probe gets
its 4xx, and afterwards no request is live, no KV is in use or locked, and the HTTP process's
memory is within RSS_BOUND_MIB of what it held after warming up.

And with a long context (so a prompt under the size cap still takes a while to tokenize), a
large prompt is tokenized off the event loop: /health keeps answering meanwhile.

``RADIXSERVE_SOAK_SECONDS`` shortens or lengthens the soak (default 40).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hardening import (
    ValidTraffic,
    assert_openai_error,
    own_server,
    reset,
    rss_mib,
    send_raw_generate,
    server_state,
    wait_idle,
)
from server_process import RunningServer
from tiny_models import make_tiny_llama_dir

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("RADIXSERVE_SOAK_SECONDS", "40"))
RSS_BOUND_MIB = 250
HANG_GUARD_S = 120
BIG_PROMPT = "a " * 2_500_000  # 5 MB


@pytest.fixture(scope="module")
def soaked(tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    tmp = tmp_path_factory.mktemp("client-soak")
    env = {"SGLANG_TORCH_PROFILER_DIR": str(tmp / "profiles")}
    flags = ["--max-body-bytes", str(32 << 20)]
    with own_server(tiny_long_llama_dir, tmp / "server.log", *flags, env=env) as running:
        yield running


def _drop(server: RunningServer, body: dict, after_s: float) -> None:
    """Send a /generate and reset the connection after ``after_s`` (a client that crashed)."""
    sock = send_raw_generate(server, body)
    time.sleep(after_s)
    reset(sock)


class Probes(threading.Thread):
    def __init__(self, server: RunningServer, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.server, self.stop, self.sent, self.wrong = server, stop, 0, list[str]()

    def _expect_4xx(self, client: httpx.Client, path: str, content: bytes, needle: str) -> None:
        response = client.post(path, content=content)
        # /update_weights_from_disk answers SGLang's {"success": false, "message"} shape
        if response.status_code != 400 or needle not in response.text:
            self.wrong.append(f"{path}: {response.status_code} {response.text[:300]}")

    def run(self) -> None:
        headers = {**self.server.headers, "Content-Type": "application/json"}
        long = {"max_new_tokens": 400, "ignore_eos": True}
        with httpx.Client(base_url=self.server.url, headers=headers, timeout=HANG_GUARD_S) as c:
            while not self.stop.is_set():
                deep = '{"text": "hi", "x": ' + "[" * 700 + "]" * 700 + ', "y": NaN}'
                self._expect_4xx(c, "/generate", deep.encode(), "nests deeper")
                big = json.dumps({"text": BIG_PROMPT}).encode()
                self._expect_4xx(c, "/generate", big, "not tokenized")
                _drop(self.server, {"text": "hello", "sampling_params": long}, 0.3)
                _drop(self.server, {"text": "hello", "sampling_params": long, "stream": True}, 0.3)
                weights = json.dumps({"model_path": "/etc"}).encode()
                self._expect_4xx(c, "/update_weights_from_disk", weights, "config.json")
                profile = json.dumps({"output_dir": "/etc", "num_steps": 2}).encode()
                self._expect_4xx(c, "/start_profile", profile, "outside the profile directory")
                r = c.post("/abort_request", content=b'{"rid": "no-such-request"}')
                if r.status_code != 200:
                    self.wrong.append(f"/abort_request: {r.status_code} {r.text[:200]}")
                self.sent += 1


def test_adversarial_soak_leaves_nothing_behind(soaked: RunningServer) -> None:
    with ValidTraffic(soaked) as warm:  # warm up: the process's steady size
        time.sleep(2)
    warm.assert_untouched()
    rss_start = rss_mib(soaked.proc.pid)
    stop = threading.Event()
    probes = Probes(soaked, stop)
    with ValidTraffic(soaked) as traffic:
        probes.start()
        time.sleep(SOAK_S)
        stop.set()
        probes.join(HANG_GUARD_S)
    assert not probes.is_alive()
    traffic.assert_untouched(at_least=5)
    assert probes.sent >= 2 and not probes.wrong, probes.wrong[:5]
    state = wait_idle(soaked, timeout=HANG_GUARD_S)
    assert state["num_live_requests"] == 0 and state["num_running_reqs"] == 0, state
    assert state["kv"]["in_use"] == 0 and state["kv"]["locked"] == 0, state
    grown = rss_mib(soaked.proc.pid) - rss_start
    assert grown < RSS_BOUND_MIB, f"the HTTP process grew by {grown:.0f} MiB"
    assert soaked.proc.poll() is None


# -- tokenizing off the event loop -------------------------------------------------------------

LONG_CONTEXT = 1 << 17  # the size cap is then 4 Mi characters


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("long-context")
    model = make_tiny_llama_dir(tmp / "model", max_position_embeddings=LONG_CONTEXT)
    flags = ["--max-body-bytes", str(32 << 20)]
    with own_server(model, tmp / "server.log", *flags) as running:
        yield running


def test_a_large_prompt_is_tokenized_off_the_event_loop(long_context: RunningServer) -> None:
    """A prompt under the size cap (a long context's) takes the tokenizer a while; /health
    must answer meanwhile, not once it is done. Measured against the request's own time, so
    it holds however fast the machine is."""
    server = long_context
    text = "hello world " * 300_000  # 3.6 M characters, ~600 k tokens: past the KV pool
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=HANG_GUARD_S) as client:
            while not done.is_set():
                start = time.perf_counter()
                assert client.get(server.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.005)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    start = time.perf_counter()
    body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
    response = httpx.post(
        server.url + "/generate", json=body, headers=server.headers, timeout=HANG_GUARD_S
    )
    took = time.perf_counter() - start
    done.set()
    thread.join(HANG_GUARD_S)
    assert_openai_error(response, range(400, 401))
    assert "tokens" in response.json()["error"]["message"]  # tokenized, then refused
    assert latencies
    assert max(latencies) < max(took / 3, 0.25), (took, sorted(latencies)[-5:])
    assert server_state(server)["num_live_requests"] == 0
