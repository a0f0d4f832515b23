"""Prefill/decode disaggregation behind the real sglang-router (PD mode), on loopback.

A prefill server and a decode server of the tiny Llama, joined by a KV connector, stand behind
``sglang_router.launch_router --pd-disaggregation``; the colocated tiny server (conftest's
``server``) is the reference. Greedy outputs through the router must equal the colocated
server's over 64 prompts (plain and streamed, with and without a cached prefix, n > 1, the
OpenAI routes too), and both engines end with no KV held (--debug-leak-check is on: a leak
stops the engine, which /health would show).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from pd_cluster import PDPair, Router, kv_state, pd_pair, pd_router
from server_process import RunningServer, start_server, stop_server

from radixserve.core.plugins import default_host

pytest.importorskip("sglang_router", reason="sglang-router is not installed (the dev extra)")

CONNECTORS = ["tcp", "mooncake", "nixl"]
TIMEOUT = 120
GREEDY = {"temperature": 0, "ignore_eos": True}
SHARED = "You are a careful assistant. Answer briefly and cite the source of every claim. "
PROMPTS = [
    (SHARED if i % 2 else "") + f"question {i}: what follows {i * 7 % 13} and {i}?"
    for i in range(64)
]


@pytest.fixture(scope="module", params=CONNECTORS)
def pair(
    request: pytest.FixtureRequest,
    tiny_long_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PDPair]:
    """The pair joined by each connector in turn; one the machine lacks is skipped."""
    backend, why_not = request.param, unavailable(request.param)
    if why_not is not None:
        pytest.skip(f"kv_transfer '{backend}' is unavailable: {why_not}")
    logs = tmp_path_factory.mktemp(f"pd-{backend}")
    # Mooncake: its TCP transport on loopback (its default address is the default route's)
    env = {"RADIXSERVE_MOONCAKE_HOST": "127.0.0.1"}
    with pd_pair(tiny_long_llama_dir, logs, backend, env=env) as p:
        yield p


@pytest.fixture(scope="module")
def router(pair: PDPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    with pd_router(pair, tmp_path_factory.mktemp("router") / "router.log") as r:
        yield r


def unavailable(backend: str) -> str | None:
    for entry in default_host().registries["kv_transfer"].entries():
        if entry.name == backend:
            return entry.unavailable_reason()
    return "no installed plugin registers it"


def generate(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    r = requests.post(url + "/generate", json=body, headers=headers or {}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def generate_stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The last event of a streamed /generate (cumulative text and ids)."""
    r = requests.post(url + "/generate", json={**body, "stream": True}, stream=True,
                      timeout=TIMEOUT)  # fmt: skip
    assert r.status_code == 200, r.text
    lines = [ln.decode() for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert all("error" not in e for e in events), events[-1]
    return events[-1]


def body_for(i: int) -> dict[str, Any]:
    params = {**GREEDY, "max_new_tokens": 6 + i % 11}
    if i % 8 == 5:
        params["n"] = 2  # both choices through the pair, each with its own room
    return {"text": PROMPTS[i], "sampling_params": params}


def reference(server: RunningServer, i: int) -> Any:
    return generate(server.url, body_for(i), server.headers)


def outputs(result: Any) -> list[tuple[str, list[int]]]:
    items = result if isinstance(result, list) else [result]
    return [(r["text"], r["output_ids"]) for r in items]


def test_router_outputs_equal_colocated(
    router: Router, pair: PDPair, server: RunningServer
) -> None:
    """64 prompts, half sharing a long prefix, sent 8 at a time, plain and streamed; then the
    same again, now served from the prefill's cache: every output equals the colocated one."""
    with ThreadPoolExecutor(8) as pool:
        want = list(pool.map(lambda i: reference(server, i), range(64)))

        def via_router(i: int) -> Any:
            body = body_for(i)
            if i % 3 == 1 and body["sampling_params"].get("n", 1) == 1:
                return generate_stream(router.url, body)
            return generate(router.url, body)

        first = list(pool.map(via_router, range(64)))
        again = list(pool.map(via_router, range(64)))
    for i in range(64):
        assert outputs(first[i]) == outputs(want[i]), (i, PROMPTS[i])
        assert outputs(again[i]) == outputs(want[i]), (i, PROMPTS[i])
    cached = [r["meta_info"]["cached_tokens"] for r in again if isinstance(r, dict)]
    assert sum(cached) > 0  # the second round's prompts came from the prefill's cache
    assert_no_kv_held(pair)


def test_router_openai_routes(router: Router, pair: PDPair, server: RunningServer) -> None:
    """Chat with n=2 (the router sends parallel room arrays) and a completion prompt batch,
    streamed and not, equal the colocated server's."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 8, "temperature": 0, "n": 2}  # fmt: skip
    comp = {"model": "m", "prompt": ["one two", "three four five"], "max_tokens": 7,
            "temperature": 0}  # fmt: skip
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
        want = requests.post(server.url + path, json=body, headers=server.headers,
                             timeout=TIMEOUT).json()  # fmt: skip
        got = requests.post(router.url + path, json=body, timeout=TIMEOUT)
        assert got.status_code == 200, got.text
        assert choices_text(got.json()) == choices_text(want)
        streamed = requests.post(router.url + path, json={**body, "stream": True},
                                 timeout=TIMEOUT, stream=True)  # fmt: skip
        assert streamed.status_code == 200
        assert stream_text(streamed) == choices_text(want)
    assert_no_kv_held(pair)


def test_router_logprobs_travel_with_kv(router: Router, server: RunningServer) -> None:
    """The first token's logprob is sampled on the prefill and reaches the client through the
    decode; the prompt's logprobs come from the prefill (the router merges them)."""
    body = {"text": PROMPTS[3], "sampling_params": {**GREEDY, "max_new_tokens": 5},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}  # fmt: skip
    want = generate(server.url, body, server.headers)["meta_info"]
    got = generate(router.url, body)["meta_info"]
    assert [t[1] for t in got["output_token_logprobs"]] == [
        t[1] for t in want["output_token_logprobs"]
    ]
    for (lp, _, _), (ref, _, _) in zip(
        got["output_token_logprobs"], want["output_token_logprobs"], strict=True
    ):
        assert lp == pytest.approx(ref, abs=1e-4)
    assert len(got["output_top_logprobs"]) == 5
    assert len(got["input_token_logprobs"]) == len(want["input_token_logprobs"])


def test_router_reads_worker_load(router: Router, pair: PDPair) -> None:
    """/get_load is SGLang's (one entry per dp rank), and a request waiting for its KV on the
    decode counts as waiting; the router's /get_loads reads it (power_of_two's input)."""
    rid = "pd-load-waiting"
    body = pair.body(123456789, text="waiting for KV that never comes", rid=rid,
                     sampling_params={**GREEDY, "max_new_tokens": 4})  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(requests.post, pair.decode.url + "/generate", json=body,
                              timeout=TIMEOUT)  # fmt: skip
        load: list[dict[str, Any]] = []
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # until the decode holds it
            load = requests.get(pair.decode.url + "/get_load", timeout=10).json()
            if load[0]["num_waiting_reqs"]:
                break
            time.sleep(0.05)
        abort = requests.post(pair.decode.url + "/abort_request", json={"rid": rid}, timeout=10)
        assert abort.status_code == 200
        waiting.result()
    assert [sorted(e) for e in load] == [["dp_rank", "num_reqs", "num_tokens", "num_waiting_reqs"]]
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 1, load
    assert load[0]["num_waiting_reqs"] == 1 and load[0]["num_tokens"] > 0, load
    loads = requests.get(router.url + "/get_loads", timeout=10)
    assert loads.status_code == 200, loads.text
    assert "-1" not in loads.text, loads.text
    assert_no_kv_held(pair)


def test_server_info_names_the_model(tiny_long_llama_dir: Path, tmp_path: Path) -> None:
    """Without --served-model-name, /server_info still names the model served and the path
    loaded (sglang-router registers a worker under them, else as "unknown")."""
    args = ["--model-path", str(tiny_long_llama_dir), "--max-total-tokens", "4096"]
    srv = start_server(args, tmp_path / "server.log")
    try:
        served = requests.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for path in ("/server_info", "/get_server_info"):
            info = requests.get(srv.url + path, timeout=10).json()
            assert info["served_model_name"] == served
            assert info["model_path"] == str(tiny_long_llama_dir)
    finally:
        stop_server(srv)


def assert_no_kv_held(pair: PDPair) -> None:
    for srv in (pair.prefill, pair.decode):
        kv = kv_state(srv)
        assert kv["in_use"] == 0 and kv["locked"] == 0, (srv.url, kv)
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200


def choices_text(response: dict[str, Any]) -> list[str]:
    out = []
    for c in sorted(response["choices"], key=lambda c: c["index"]):
        out.append(c["message"]["content"] if "message" in c else c["text"])
    return out


def stream_text(response: requests.Response) -> list[str]:
    texts: dict[int, str] = {}
    for line in response.iter_lines():
        if not line or line == b"data: [DONE]":
            continue
        chunk = json.loads(line.decode()[len("data: ") :])
        for c in chunk.get("choices", []):
            piece = c["delta"].get("content") if "delta" in c else c.get("text")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return [texts[i] for i in sorted(texts)]
