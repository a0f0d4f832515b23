"""Prefill/decode disaggregation when transfers fail: a connection dropped mid-transfer, a
bootstrap_room the prefill never gets, a client abort while the decode waits for KV, and the
prefill server killed while it sends. Each affected request ends with a clear error within a
bounded time, other requests go on, and neither server holds KV afterwards.

The servers use ``tcp_faults`` (tests/support/radixserve_test_kv_faults.py): the tcp connector
with faults the test picks through the room number, and with events (a file the connector
creates when it stalls) instead of timing. Requests go to both servers as sglang-router sends
them (the same body and room, at the same time), without the router in between.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from model_gate import install_plugin
from pd_cluster import PDPair, kv_state, pd_pair
from radixserve_test_kv_faults import DROP_ROOM, FAULT_DIR_ENV, STALL_ROOM
from server_process import RunningServer

TIMEOUT = 60
TRANSFER_TIMEOUT_S = 3  # --disaggregation-transfer-timeout of these servers
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-faults")


@pytest.fixture(scope="module")
def pair(tiny_long_llama_dir: Path, fault_dir: Path) -> Iterator[PDPair]:
    env = {**install_plugin(fault_dir / "site", "radixserve_test_kv_faults")}
    env[FAULT_DIR_ENV] = str(fault_dir)
    extra = ["--disaggregation-transfer-timeout", str(TRANSFER_TIMEOUT_S)]
    with pd_pair(tiny_long_llama_dir, fault_dir, "tcp_faults", extra, env) as p:
        yield p


def room(kind: int = 0) -> int:
    """A fresh room; ``kind`` (room % 1000) picks the connector's fault."""
    return random.randrange(1, 1 << 40) * 1000 + kind


def post(url: str, body: dict[str, Any], path: str = "/generate") -> requests.Response:
    return requests.post(url + path, json=body, timeout=TIMEOUT)


def send_pair(pool: ThreadPoolExecutor, pair: PDPair, r: int, text: str) -> tuple[Future, Future]:
    body = pair.body(r, text=text, sampling_params=GREEDY)
    return pool.submit(post, pair.prefill.url, body), pool.submit(post, pair.decode.url, body)


def assert_ok_pair(futures: tuple[Future, Future]) -> None:
    prefill, decode = (f.result() for f in futures)
    assert prefill.status_code == 200, prefill.text
    assert decode.status_code == 200, decode.text
    assert len(decode.json()["output_ids"]) == GREEDY["max_new_tokens"]


def assert_no_kv_held(*servers: Any) -> None:
    for srv in servers:
        kv = kv_state(srv)
        assert kv["in_use"] == 0 and kv["locked"] == 0, (srv.url, kv)


def test_connection_dropped_mid_transfer(pair: PDPair) -> None:
    with ThreadPoolExecutor(4) as pool:
        bad = send_pair(pool, pair, room(DROP_ROOM), "a transfer that breaks halfway")
        good = send_pair(pool, pair, room(), "a transfer that completes")
        prefill, decode = (f.result() for f in bad)
        assert_ok_pair(good)
    assert prefill.status_code == 200  # the prefill did its part
    assert decode.status_code == 500
    message = decode.json()["error"]["message"]
    assert "failed: the connection closed after" in message and "bytes" in message, message
    assert_no_kv_held(pair.prefill, pair.decode)


def test_room_that_never_arrives(pair: PDPair) -> None:
    """The decode alone gets the room: it gives up after the transfer timeout, frees the
    slots it preallocated, and serves other pairs meanwhile."""
    lost = pair.body(room(), text="nobody prefills this", sampling_params=GREEDY)
    with ThreadPoolExecutor(4) as pool:
        waiting = pool.submit(post, pair.decode.url, lost)
        assert_ok_pair(send_pair(pool, pair, room(), "others go on"))
        started = time.monotonic()
        decode = waiting.result()
    assert time.monotonic() - started < TRANSFER_TIMEOUT_S + 10
    assert decode.status_code == 500
    message = decode.json()["error"]["message"]
    assert f"timed out after {TRANSFER_TIMEOUT_S} s waiting for its KV" in message, message
    assert_no_kv_held(pair.prefill, pair.decode)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "grammar"])
def test_prefill_refusal_reaches_the_decode(pair: PDPair, route: str) -> None:
    """The prefill refuses its copy of a call (here: a bad parameter only it gets, as when it
    is overloaded; or a grammar its engine refuses); the decode's request ends at once with the
    prefill's reason and the same client error (400: sglang-router neither retries it nor
    counts it against the workers), not a timeout or a 500."""
    r = room()
    if route == "/generate":
        good = pair.body(r, text="refused on the prefill", sampling_params=GREEDY)
        bad = {**good, "sampling_params": {**GREEDY, "temperature": -1}}
    elif route == "grammar":  # refused in the prefill's engine, once the request was queued
        good = pair.body(r, text="refused on the prefill", sampling_params=GREEDY)
        bad = {**good, "sampling_params": {**GREEDY, "regex": "[0-9]{100}"}}
        route = "/generate"
        # compiled once first (it is cached): the refusal then comes well before the
        # decode's transfer timeout
        warm = {"text": "x", "sampling_params": bad["sampling_params"]}
        assert post(pair.prefill.url, warm).status_code == 400
    else:
        good = pair.body(r, model="m", prompt="refused on the prefill", max_tokens=4)
        bad = {**good, "max_tokens": 10**6}
    with ThreadPoolExecutor(2) as pool:
        decode = pool.submit(post, pair.decode.url, good, route)
        refused = post(pair.prefill.url, bad, route)
        answer = decode.result()
    assert refused.status_code == 400, refused.text
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "the prefill server refused the request" in message, message
    assert_no_kv_held(pair.prefill, pair.decode)


def test_prefill_checks_a_grammar_against_the_clients_budget(
    pair: PDPair, server: RunningServer
) -> None:
    """The prefill samples one token, but a grammar whose outputs are all longer than that
    fits the client's max_new_tokens: the pair serves it as one server does."""
    params = {"temperature": 0, "max_new_tokens": 16, "regex": "[0-9]{40}"}
    body: dict[str, Any] = {"text": "digits please", "sampling_params": params}
    alone = requests.post(server.url + "/generate", json=body, headers=server.headers,
                          timeout=TIMEOUT)  # fmt: skip
    assert alone.status_code == 200, alone.text
    urls = [pair.prefill.url, pair.decode.url]
    for url in urls:  # compiled first (it is cached): well within the transfer timeout then
        assert post(url, body).status_code == 200
    with ThreadPoolExecutor(2) as pool:
        both = pair.body(room(), **body)
        answers = list(pool.map(lambda url: post(url, both), urls))
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[1].json()["text"] == alone.json()["text"]
    assert_no_kv_held(pair.prefill, pair.decode)


def test_staged_kv_expires_while_the_prefill_is_idle(pair: PDPair) -> None:
    """KV that no decode asks for is dropped after the transfer timeout, also when nothing
    else happens on the prefill afterwards (no request, no engine step)."""
    r = room()
    body = pair.body(r, text="no decode asks for this", sampling_params=GREEDY)
    assert post(pair.prefill.url, body).status_code == 200
    dropped = f"no decode server asked for the KV of room {r}"
    deadline = time.monotonic() + TIMEOUT
    while dropped not in pair.prefill.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dropped in pair.prefill.log()


def test_bootstrap_server_listens_on_the_server_host(pair: PDPair) -> None:
    """The servers run with --host 127.0.0.1: so does the prefill's KV bootstrap server."""
    listening = [
        c.laddr.ip
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == pair.bootstrap_port
    ]
    assert listening == ["127.0.0.1"]


def test_decode_refusal_reaches_the_prefill(pair: PDPair) -> None:
    """The decode refuses its copy of a call (a bad parameter only it gets): it tells the
    prefill, which then refuses its own copy with the decode's reason instead of computing
    KV that no one will fetch (and keeping it for the transfer timeout)."""
    r = room()
    good = pair.body(r, text="refused on the decode", sampling_params=GREEDY)
    bad = {**good, "sampling_params": {**GREEDY, "temperature": -1}}
    refused = post(pair.decode.url, bad)
    assert refused.status_code == 400, refused.text
    deadline = time.monotonic() + TIMEOUT
    while f"room {r} given up" not in pair.prefill.log() and time.monotonic() < deadline:
        time.sleep(0.05)  # the prefill logs the room once its bootstrap server has the news
    answer = post(pair.prefill.url, good)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "the decode server refused the request" in message and "temperature" in message
    assert_no_kv_held(pair.prefill, pair.decode)


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_constrained_decoding_through_the_pair(
    pair: PDPair, server: RunningServer, route: str
) -> None:
    """A grammar travels: the prefill samples the first token under it, the decode's matcher
    takes that token and goes on. The output equals the colocated server's and is valid."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    if route == "/generate":
        params = {"temperature": 0, "max_new_tokens": 24, "json_schema": json.dumps(schema)}
        body: dict[str, Any] = {"text": "json please", "sampling_params": params}
    else:
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        messages = [{"role": "user", "content": "json please"}]
        body = {"model": "m", "messages": messages, "max_tokens": 24, "temperature": 0,
                "response_format": fmt}  # fmt: skip
    alone = requests.post(server.url + route, json=body, headers=server.headers, timeout=TIMEOUT)
    assert alone.status_code == 200, alone.text
    with ThreadPoolExecutor(2) as pool:
        both, urls = pair.body(room(), **body), [pair.prefill.url, pair.decode.url]
        answers = list(pool.map(lambda url: post(url, both, route), urls))
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    if route == "/generate":
        got, want = answers[1].json()["text"], alone.json()["text"]
    else:
        got = answers[1].json()["choices"][0]["message"]["content"]
        want = alone.json()["choices"][0]["message"]["content"]
    assert got == want
    assert isinstance(json.loads(got)["a"], int), got
    assert_no_kv_held(pair.prefill, pair.decode)


def test_client_abort_while_waiting_for_kv(pair: PDPair) -> None:
    rid = f"pd-abort-{room()}"
    body = pair.body(room(), text="aborted while it waits", sampling_params=GREEDY, rid=rid)
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(post, pair.decode.url, body)
        deadline = time.monotonic() + TIMEOUT
        while not _live(pair.decode.url) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the decode holds the request
        assert post(pair.decode.url, {"rid": rid}, "/abort_request").status_code == 200
        decode = waiting.result()
    finish = decode.json()["meta_info"]["finish_reason"] if decode.status_code == 200 else None
    assert finish is not None and finish["type"] == "abort", decode.text
    assert_no_kv_held(pair.decode)


def test_prefill_killed_during_transfer(pair: PDPair, fault_dir: Path) -> None:
    """The prefill dies with half of the KV sent: the decode's request fails at once with the
    reason, and the decode goes on serving (last test: the prefill stays down)."""
    r = room(STALL_ROOM)
    with ThreadPoolExecutor(2) as pool:
        futures = send_pair(pool, pair, r, "the prefill dies while sending this")
        marker = fault_dir / f"stalled-{r}"
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the prefill never started the transfer"
        _kill_tree(pair.prefill.proc.pid)
        decode = futures[1].result()
    assert decode.status_code == 500
    message = decode.json()["error"]["message"]
    assert "the connection to the prefill server" in message, message
    assert_no_kv_held(pair.decode)
    plain = post(pair.decode.url, {"text": "still serving", "sampling_params": GREEDY})
    assert plain.status_code == 200, plain.text


def _live(url: str) -> bool:
    info = requests.get(url + "/server_info", timeout=10).json()
    return info["num_live_requests"] > 0


def _kill_tree(pid: int) -> None:
    """SIGKILL a server and its engine process at once, as a machine failure would."""
    proc = psutil.Process(pid)
    for p in [*proc.children(recursive=True), proc]:
        p.kill()
    psutil.wait_procs([proc], timeout=10)


def test_refusals_that_are_the_callers_fault() -> None:
    """Which refused calls a prefill reports as the caller's fault (the decode answers 400)
    and which as its own (500): an overloaded prefill must not turn into a client error."""
    from radixserve.core.request import InvalidRequest
    from radixserve.entrypoints.admission import Overloaded
    from radixserve.entrypoints.engine_client import EngineDied
    from radixserve.entrypoints.http_errors import ApiError, is_client_error

    assert is_client_error(InvalidRequest("temperature must be >= 0"))
    assert is_client_error(ApiError(404, "no such model"))
    assert not is_client_error(ApiError(503, "draining"))
    assert not is_client_error(Overloaded("the queue is full", 1))
    assert not is_client_error(EngineDied("gone"))
    assert not is_client_error(RuntimeError("a bug"))
