"""Issue 13: one request must never take the server down. Every request the issue lists is a
named regression test here, against the shared tiny-model server (--debug-leak-check): each is
answered (served, or refused with a 4xx naming the field), the engine lives, and afterwards no
live request, KV slot or cache lock is left behind."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
from hardening import assert_openai_error, is_idle, wait_idle
from server_process import TINY_MODEL_NAME, RunningServer

BEYOND_64_BITS = 1180591620717411303424  # 2**70, the lock-out seed
MSGS = [{"role": "user", "content": "Hi"}]


def post(server: RunningServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60, **kw)


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "prompt": "Hi", "max_tokens": 3, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "messages": MSGS, "max_tokens": 3, **kw}


def native(**sampling: Any) -> dict[str, Any]:
    return {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **sampling}}


def assert_alive_and_clean(server: RunningServer) -> None:
    ok = post(server, "/generate", native(ignore_eos=True))
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4, ok.text
    state = wait_idle(server, timeout=30)
    assert is_idle(state), state
    assert server.proc.poll() is None, server.log()[-3000:]


def assert_refused(r: httpx.Response, *needles: str) -> None:
    assert_openai_error(r, range(400, 401))
    message = r.json()["error"]["message"]
    for needle in needles:
        assert needle in message, message


# -- 1. large seeds -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", completion(seed=20000000000000)),
        ("/v1/chat/completions", chat(seed=2**63)),
        ("/generate", native(seed=2**63)),
        ("/generate", native(sampling_seed=2**64 - 1)),
    ],
)
def test_large_seed_is_served(server: RunningServer, path: str, body: dict[str, Any]) -> None:
    """Any seed in [0, 2**64) is served (folded to 63 bits where the sampler uses it)."""
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    assert_alive_and_clean(server)


def test_large_seed_is_deterministic(server: RunningServer) -> None:
    body = native(seed=2**64 - 1, temperature=1.0, ignore_eos=True, max_new_tokens=8)
    first, second = post(server, "/generate", body), post(server, "/generate", body)
    assert first.json()["output_ids"] == second.json()["output_ids"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", completion(seed=BEYOND_64_BITS)),
        ("/v1/chat/completions", chat(seed=2**64)),
        ("/generate", native(seed=BEYOND_64_BITS)),
        ("/generate", native(seed=-1)),
        ("/v1/completions", completion(seed=True)),
        ("/generate", native(seed="7")),
    ],
)
def test_seed_outside_64_bits_is_400(server: RunningServer, path: str, body: dict) -> None:
    assert_refused(post(server, path, body), "seed")
    assert_alive_and_clean(server)


# -- 2. booleans of the wrong type ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", native(ignore_eos="yes"), "ignore_eos"),
        ("/generate", native(skip_special_tokens="yes"), "skip_special_tokens"),
        ("/generate", native(no_stop_trim="yes"), "no_stop_trim"),
        ("/generate", native(logprobs="x"), "logprobs"),
        ("/generate", native(logprobs=1), "logprobs"),
        ("/generate", {**native(), "return_logprob": "x"}, "return_logprob"),
        ("/generate", {**native(), "return_text_in_logprobs": 1}, "return_text_in_logprobs"),
        ("/generate", {**native(), "stream": "yes"}, "stream"),
        ("/v1/completions", completion(ignore_eos="yes"), "ignore_eos"),
        ("/v1/completions", completion(echo=1), "echo"),
        ("/v1/chat/completions", chat(logprobs="true"), "logprobs"),
        ("/v1/chat/completions", chat(skip_special_tokens=0), "skip_special_tokens"),
        ("/v1/chat/completions", chat(max_tokens=True), "max_tokens"),
        ("/v1/chat/completions", chat(n=2.0), "n"),
        ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ],
)
def test_wrong_type_field_is_400(server: RunningServer, path: str, body: dict, field: str) -> None:
    """Booleans are strictly true/false and integers strictly integers, on every route."""
    assert_refused(post(server, path, body), field)
    assert_alive_and_clean(server)


# -- 3. oversized integers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (native(top_k=2**63), "top_k"),
        ({**native(), "return_logprob": True, "top_logprobs_num": 1_000_000}, "top_logprobs_num"),
        ({**native(), "return_logprob": True, "top_logprobs_num": 2**63}, "top_logprobs_num"),
        (native(logprobs=True, top_logprobs_num=2**70), "top_logprobs_num"),
        ({**native(), "return_logprob": True, "logprob_start_len": 2**70}, "logprob_start_len"),
        (native(max_new_tokens=2**70), "max_new_tokens"),
        (native(min_new_tokens=2**64), "min_new_tokens"),
        (native(n=2**70), "n"),
        (native(stop_token_ids=[2**70]), "stop_token_ids"),
        ({"input_ids": [2**70], "sampling_params": {"max_new_tokens": 1}}, "token id"),
    ],
)
def test_oversized_native_integer_is_400(server: RunningServer, body: dict, field: str) -> None:
    assert_refused(post(server, "/generate", body), field)
    assert_alive_and_clean(server)


def test_top_logprobs_above_the_server_limit_is_400(server: RunningServer) -> None:
    body = {**native(), "return_logprob": True, "top_logprobs_num": 101}
    assert_refused(post(server, "/generate", body), "--max-top-logprobs")


def test_top_k_beyond_the_vocabulary_keeps_every_token(server: RunningServer) -> None:
    r = post(server, "/generate", native(top_k=2**63 - 1, temperature=1.0))
    assert r.status_code == 200, r.text
    body = {**native(), "return_logprob": True, "top_logprobs_num": 100}
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["meta_info"]["output_top_logprobs"][0]) == 100
    assert_alive_and_clean(server)


# -- 5. the lock-out ------------------------------------------------------------------------------


def test_seeds_of_n_choices_wrap_within_64_bits(server: RunningServer) -> None:
    r = post(server, "/v1/completions", completion(seed=2**64 - 1, n=3, temperature=1.0))
    assert r.status_code == 200, r.text
    assert_alive_and_clean(server)


def test_request_the_engine_cannot_receive_is_400_and_holds_no_slot() -> None:
    """Were anything to get past validation that the message encoder refuses (the issue's
    OverflowError in entrypoints/ipc.py), the request is a 400 and never becomes live: a request
    counts against the admission limit only once the engine has it."""
    from types import SimpleNamespace

    from radixserve.core.request import InvalidRequest, SamplingParams
    from radixserve.entrypoints.tokenizer_manager import TokenizerManager

    sent: list[bytes] = []
    client = SimpleNamespace(dead=None, send_encoded=sent.append, on_step=None, on_death=None)
    ready = SimpleNamespace(lora_adapters=None, model_dir="")
    tm = TokenizerManager(client, ready, SimpleNamespace())  # type: ignore[arg-type]
    unencodable = SamplingParams(seed=BEYOND_64_BITS)  # built directly: never validated
    with pytest.raises(InvalidRequest, match="cannot be passed to the engine"):
        tm.submit([5, 6], unencodable, asyncio.Event())
    assert tm.reqs == {} and sent == []


def test_lockout_burst_leaves_the_server_serving(server: RunningServer) -> None:
    """1,100 refused requests in a burst (more than the 1,088 live-request limit): every one is
    a 400, none holds an admission slot, and a normal request is served right after."""

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(headers=server.headers, timeout=60, limits=limits) as c:
            body = completion(seed=BEYOND_64_BITS)
            url = server.url + "/v1/completions"
            responses = await asyncio.gather(*(c.post(url, json=body) for _ in range(1100)))
            return [r.status_code for r in responses]

    statuses = asyncio.run(burst())
    assert statuses == [400] * 1100, {s: statuses.count(s) for s in set(statuses)}
    r = post(server, "/v1/completions", completion())
    assert r.status_code == 200, r.text
    assert_alive_and_clean(server)


# -- 6. bodies that are not objects; errors and keep-alive ----------------------------------------


@pytest.mark.parametrize("path", ["/tokenize", "/abort_request", "/detokenize", "/generate"])
@pytest.mark.parametrize("body", [b"[1]", b"null", b'"x"', b"3", b"true"])
def test_non_object_body_is_400(server: RunningServer, path: str, body: bytes) -> None:
    headers = {**server.headers, "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        r = client.post(path, content=body)
        assert_refused(r, "JSON object")
        again = client.post("/tokenize", json={"prompt": "hello"})  # same connection
        assert again.status_code == 200, again.text


# -- 7. too many prompts in one call ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", completion(prompt=["Hi"] * 10_000, max_tokens=1)),
        ("/v1/completions", completion(prompt=["Hi"] * 600, n=2, max_tokens=1)),
        ("/generate", {"text": ["Hi"] * 10_000, "sampling_params": {"max_new_tokens": 1}}),
        ("/generate", {"input_ids": [[5, 6]] * 10_000, "sampling_params": {"max_new_tokens": 1}}),
    ],
)
def test_batch_that_can_never_fit_is_400(server: RunningServer, path: str, body: dict) -> None:
    """Not a 503 with Retry-After: retrying could never succeed."""
    r = post(server, path, body)
    assert_refused(r, "--max-queued-requests")
    assert "Retry-After" not in r.headers
    assert_alive_and_clean(server)


def test_live_requests_return_to_zero(server: RunningServer) -> None:
    """The leak invariant the hardening tests check includes the server's live requests."""
    state = wait_idle(server, timeout=30)
    assert is_idle(state), json.dumps(state)[:2000]


def test_unhandled_error_is_json_500_and_the_connection_stays_usable() -> None:
    """An exception no handler knows becomes a JSON 500 (not Starlette's text/plain one, which
    re-raises and makes uvicorn reset the connection); the next request on the same keep-alive
    connection is served."""
    import threading

    import uvicorn
    from fastapi import FastAPI
    from server_process import free_port

    from radixserve.entrypoints.http_errors import GuardMiddleware, install_error_handlers
    from radixserve.entrypoints.http_protocol import guarded_h11

    app = FastAPI()
    app.add_middleware(GuardMiddleware, api_key=None, max_body_bytes=1 << 20)
    install_error_handlers(app)

    @app.post("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug nobody handled")

    @app.get("/ok")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    port = free_port()
    config = uvicorn.Config(app, port=port, log_level="critical", http=guarded_h11(30.0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(400):
            if server.started:
                break
            threading.Event().wait(0.05)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            reader = sock.makefile("rb")
            sock.sendall(b"POST /boom HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            status, headers, body = _read_response(reader)
            assert status == 500 and headers[b"content-type"] == b"application/json", body
            assert "RuntimeError" in json.loads(body)["error"]["message"]
            sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection
            status, _, body = _read_response(reader)
            assert status == 200 and json.loads(body) == {"ok": True}
    finally:
        server.should_exit = True
        thread.join(30)


def _read_response(reader: Any) -> tuple[int, dict[bytes, bytes], bytes]:
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, reader.read(int(headers[b"content-length"]))
