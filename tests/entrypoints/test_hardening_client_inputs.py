"""Nothing a client sends may stall the server, bloat it or touch the host: deep JSON that only
Python's parser accepts, prompts far past the context, dropped non-streaming connections, a bad
weights path while a request runs, profile output outside the profile directory.

One tiny-model server runs GatedLlama (tests/support/radixserve_test_models.py): a test holds a
request inside its model step with the gate, or paces every step (each lasts at least PACE_S),
so "still running" never depends on how fast the machine generates."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hardening import (
    assert_openai_error,
    own_server,
    reset,
    rss_mib,
    send_raw_generate,
    wait_idle,
    wait_state,
)
from model_gate import PACE_S, Gate, gated_prompt, install_test_models
from server_process import RunningServer

HANG_GUARD_S = 120  # only stops a hung test; no outcome depends on it
BIG_BODY_LIMIT = 32 << 20  # the default --max-body-bytes (the shared tiny server's is 1 MiB)
DEPTH_MESSAGE = "nests deeper than 256 levels"


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Gate:
    return Gate(tmp_path_factory.mktemp("gate"))


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(
    tiny_long_llama_dir: Path,
    gate: Gate,
    profile_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("client-inputs")
    env = {**install_test_models(tmp / "site"), **gate.env}
    env["SGLANG_TORCH_PROFILER_DIR"] = str(profile_root)
    flags = ["--plugin", "model=GatedLlama", "--max-body-bytes", str(BIG_BODY_LIMIT)]
    with own_server(tiny_long_llama_dir, tmp / "server.log", *flags, env=env) as running:
        yield running
    gate.open()
    gate.pace(False)


def post(server: RunningServer, path: str, content: bytes, timeout: float = 60) -> httpx.Response:
    headers = {**server.headers, "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


# -- deep JSON -------------------------------------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


CHAT_HEAD = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]'
# where a deep value hides in a chat request, and how deep (past 256; within Python's parser)
DEEP_PLACES = {
    "chat_template_kwargs": (600, CHAT_HEAD + ', "chat_template_kwargs": {"x": DEEP}'),
    "tools": (
        900,
        CHAT_HEAD + ', "tools": [{"type": "function", "function": {"name": "f", '
        '"parameters": {"type": "object", "x": DEEP}}}]',
    ),
    "documents": (900, CHAT_HEAD + ', "documents": [{"x": DEEP}]'),
    "tool_calls": (
        900,
        '{"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": '
        '[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, '
        '"x": DEEP}]}, {"role": "user", "content": "hi"}]',
    ),
}
# what msgspec refuses and Python's json takes: the body then reached the handlers un-checked
TRIGGERS = {
    "nan": (', "temperature": NaN', "utf-8"),
    "surrogate": (', "user": "\\ud800"', "utf-8"),
    "utf16": ("", "utf-16"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("trigger", sorted(TRIGGERS))
@pytest.mark.parametrize("place", sorted(DEEP_PLACES))
def test_deep_json_is_a_400_whichever_parser_takes_it(
    server: RunningServer, place: str, trigger: str, stream: bool
) -> None:
    """Was a 500 (RecursionError) and ~2,900 traceback lines in the log per request."""
    depth, template = DEEP_PLACES[place]
    extra, encoding = TRIGGERS[trigger]
    text = template.replace("DEEP", _nested(depth)) + extra + f', "stream": {json.dumps(stream)}}}'
    json.loads(text)  # the probe is JSON to Python's parser, as it must be
    before = server.log()
    response = post(server, "/v1/chat/completions", text.encode(encoding, "surrogatepass"))
    assert_openai_error(response, range(400, 401))
    assert DEPTH_MESSAGE in response.json()["error"]["message"]
    new = server.log()[len(before) :]
    assert "Traceback" not in new and "RecursionError" not in new, new[-3000:]
    assert new.count(DEPTH_MESSAGE) == 1, new  # one log line per refusal


@pytest.mark.parametrize("route", ["/generate", "/tokenize", "/encode"])
def test_deep_json_on_self_parsed_routes(server: RunningServer, route: str) -> None:
    body = '{"text": "hi", "x": ' + _nested(600) + ', "y": NaN}'
    response = post(server, route, body.encode())
    assert_openai_error(response, range(400, 401))
    assert DEPTH_MESSAGE in response.json()["error"]["message"]


# -- prompts far past the context --------------------------------------------------------------

BIG_TEXT = "a " * 10_000_000  # 20 MB; ~10 million tokens, for a 2,048-token context

BIG_BODIES = {
    "/generate": {"text": BIG_TEXT, "sampling_params": {"max_new_tokens": 1}},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": BIG_TEXT}]},
    "/v1/completions": {"model": "m", "prompt": BIG_TEXT, "max_tokens": 1},
    "/tokenize": {"prompt": BIG_TEXT},
    "/v1/embeddings": {"model": "m", "input": BIG_TEXT},
}


class HealthProbe(threading.Thread):
    """Asks /health over and over; records each answer's latency."""

    def __init__(self, server: RunningServer) -> None:
        super().__init__(daemon=True)
        self.server, self.stop, self.latencies = server, threading.Event(), list[float]()

    def run(self) -> None:
        with httpx.Client(timeout=HANG_GUARD_S) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                assert client.get(self.server.url + "/health").status_code == 200
                self.latencies.append(time.perf_counter() - start)
                time.sleep(0.01)


def test_a_20mb_prompt_is_refused_before_tokenizing(server: RunningServer) -> None:
    """Was tokenized first: 15-28 s per request in the HTTP process, /health stalled 17.9 s,
    and the process grew by ~3 GB. Now each is refused on its length alone (the message counts
    characters: no token count exists), /health keeps answering, and the memory goes back."""
    bodies = {route: json.dumps(body).encode() for route, body in BIG_BODIES.items()}
    rss_start = rss_mib(server.proc.pid)
    probe = HealthProbe(server)
    probe.start()
    try:
        for _ in range(2):
            for route, content in bodies.items():
                response = post(server, route, content, timeout=HANG_GUARD_S)
                assert_openai_error(response, range(400, 401))
                message = response.json()["error"]["message"]
                assert re.search(r"has 200000\d\d characters", message), message
                assert "not tokenized" in message, message
    finally:
        probe.stop.set()
        probe.join(HANG_GUARD_S)
    assert probe.latencies
    # NOTE: a bound with a wide margin: what /health waits behind is the JSON decode of a
    # 20 MB body (tens of ms), never tokenizing (which took seconds per request)
    assert max(probe.latencies) < 2.0, sorted(probe.latencies)[-5:]
    del bodies
    grown = rss_mib(server.proc.pid) - rss_start
    assert grown < 200, f"the HTTP process grew by {grown:.0f} MiB"
    # a prompt just inside the cap is tokenized and refused on its token count, as before
    fits = {"text": "a " * 30_000, "sampling_params": {"max_new_tokens": 1}}
    response = post(server, "/generate", json.dumps(fits).encode())
    assert_openai_error(response, range(400, 401))
    assert "tokens" in response.json()["error"]["message"]


def test_a_query_copied_into_every_item_cannot_pass_the_size_cap(server: RunningServer) -> None:
    """/v1/score builds one prompt per item, each with the query: a 60 KB body made 60 MB of
    text to tokenize (each prompt alone under the cap), and a token-id query was copied into
    every item before any length check. Both are refused before the prompts are built."""
    rss_start = rss_mib(server.proc.pid)
    query = "x " * 30_000  # 60,000 characters: one prompt fits the 65,536-character cap
    body = {"query": query, "items": ["a"] * 1000, "label_token_ids": [1, 2]}
    response = post(server, "/v1/score", json.dumps(body).encode())
    assert_openai_error(response, range(400, 401))
    assert "characters together" in response.json()["error"]["message"], response.text
    ids = {"query": [5] * 200_000, "items": [[1]] * 300, "label_token_ids": [1, 2]}
    response = post(server, "/v1/score", json.dumps(ids).encode())
    assert_openai_error(response, range(400, 401))
    assert "the prompt has 200001 tokens" in response.json()["error"]["message"], response.text
    grown = rss_mib(server.proc.pid) - rss_start
    assert grown < 200, f"the HTTP process grew by {grown:.0f} MiB"


# -- dropped non-streaming clients ------------------------------------------------------------


def test_dropped_non_streaming_clients_are_aborted_at_once(
    server: RunningServer, gate: Gate
) -> None:
    """Was noticed only once no token had arrived for 1 s: requests whose tokens kept coming
    ran on for their whole length. Paced, each of these requests would run for at least
    600 * PACE_S = 30 s; dropped, they must be gone within 2 s while their tokens still flow."""
    count, tokens = 6, 600
    assert tokens * PACE_S >= 15  # cannot end by itself within the bound below
    body = {"text": "hello", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
    gate.pace()
    try:
        socks = [send_raw_generate(server, body) for _ in range(count)]
        state = wait_state(server, lambda s: s["num_running_reqs"] == count, HANG_GUARD_S)
        assert state["num_running_reqs"] == count, state
        dropped = time.monotonic()
        for sock in socks:
            reset(sock)
        state = wait_state(server, lambda s: s["num_live_requests"] == 0, 30)
        elapsed = time.monotonic() - dropped
    finally:
        gate.pace(False)
    assert state["num_live_requests"] == 0 and state["num_running_reqs"] == 0, state
    assert elapsed < 2.0, f"the dropped requests ran on for {elapsed:.1f} s"
    state = wait_idle(server, timeout=HANG_GUARD_S)
    assert state["kv"]["in_use"] == 0 and state["kv"]["locked"] == 0, state


# -- admin routes ------------------------------------------------------------------------------


@contextlib.contextmanager
def _request_held(server: RunningServer, gate: Gate) -> Iterator[list[httpx.Response]]:
    """One /generate request held inside its model step until the block ends; the list it
    yields stays empty while the request runs, and the request must then end with a 200."""
    payload = {"input_ids": gated_prompt(), "sampling_params": {"max_new_tokens": 4}}
    results: list[httpx.Response] = []

    def run() -> None:
        url = server.url + "/generate"
        results.append(httpx.post(url, json=payload, headers=server.headers, timeout=HANG_GUARD_S))

    gate.close()
    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        gate.wait_entered(gate.entered() + 1)
        yield results
    finally:
        gate.open()
    thread.join(HANG_GUARD_S)
    assert results and results[0].status_code == 200, results


def test_a_bad_weights_path_is_a_400_before_anything_pauses(
    server: RunningServer, gate: Gate
) -> None:
    """Was checked only after admission paused and the running request finished (a tiny
    request waited 369.8 s). Here the running request is held inside its model step for as
    long as the test likes: the update must answer meanwhile."""
    with _request_held(server, gate) as results:
        url = server.url + "/update_weights_from_disk"
        for path, needle in [
            ("/etc", "config.json"),
            ("/", "config.json"),
            ("/no/such/checkpoint", "not a model directory"),
        ]:
            r = httpx.post(url, json={"model_path": path}, headers=server.headers, timeout=30)
            assert r.status_code == 400, r.text
            assert r.json()["success"] is False and needle in r.json()["message"], r.text
            assert r.json()["num_paused_requests"] == 0
        assert not results  # the held request is still running: nothing waited for it


def test_an_existing_file_as_weights_path_is_refused_at_once(
    server: RunningServer, gate: Gate, tmp_path: Path
) -> None:
    """A file that cannot be a checkpoint (not a .gguf) skipped the early check: admission
    paused until the running request ended. A name too long for the file system was a 500."""
    not_a_checkpoint = tmp_path / "weights.bin"
    not_a_checkpoint.write_bytes(b"\0" * 16)
    with _request_held(server, gate) as results:
        url = server.url + "/update_weights_from_disk"
        for path, needle in [
            (str(not_a_checkpoint), "not a model directory"),
            ("/" + "a" * 5000, "cannot be a path here"),
        ]:
            r = httpx.post(url, json={"model_path": path}, headers=server.headers, timeout=30)
            assert r.status_code == 400, r.text
            text = r.json().get("message") or r.json()["error"]["message"]
            assert needle in text, r.text
        assert not results  # the held request is still running: nothing waited for it


def test_profile_output_outside_its_directory_is_refused(
    server: RunningServer, profile_root: Path, tmp_path: Path
) -> None:
    """Was 200, and a trace written into /etc."""
    before = set(Path("/etc").iterdir())
    for output_dir in ["/etc", str(tmp_path), "../x", "/"]:
        content = json.dumps({"output_dir": output_dir, "num_steps": 2}).encode()
        response = post(server, "/start_profile", content)
        assert_openai_error(response, range(400, 401))
        assert "outside the profile directory" in response.json()["error"]["message"]
    stop = post(server, "/stop_profile", b"")
    assert "not in progress" in stop.json()["error"]["message"]  # nothing started
    assert set(Path("/etc").iterdir()) == before and list(tmp_path.iterdir()) == []
    response = post(server, "/start_profile", json.dumps({"num_steps": 2147483648}).encode())
    assert_openai_error(response, range(400, 401))


def test_the_start_up_line_names_the_admin_access(server: RunningServer) -> None:
    assert "admin routes (" in server.log() and "answer only loopback clients" in server.log()
