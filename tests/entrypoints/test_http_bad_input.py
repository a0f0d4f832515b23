"""Bad input the other HTTP modules leave out, so each case below is covered on every route.

Already covered elsewhere (not repeated): test_http_openai.py - chat: negative temperature,
top_p 0 / 1.5, n 0, max_tokens beyond the context, empty messages, a LoRA adapter in the model
name (400; other names are accepted; strict mode's 404 is in test_openai_fields.py),
completions: prompt beyond the context; raw: invalid JSON and missing ``messages`` on chat, an
unknown /v1 route (404), an oversized body with a Content-Length (413), a wrong key on GET
/v1/models (401). test_http_native.py - /generate: invalid JSON, negative temperature,
max_new_tokens and input_ids beyond the context.

Added here: the same limits on /v1/completions and /generate where missing, a chat prompt
beyond the context, a wrong or missing key on POST routes, unknown non-/v1 routes, and
oversized bodies on /generate and sent chunked (no Content-Length).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
from server_process import (
    TINY_CONTEXT,
    TINY_MAX_BODY_BYTES,
    TINY_MODEL_NAME,
    RunningServer,
)

TIMEOUT = 60
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def post(
    server: RunningServer, path: str, body: Any = None, headers: dict | None = None, **kw: Any
) -> requests.Response:
    h = server.headers if headers is None else headers
    return requests.post(server.url + path, json=body, headers=h, timeout=TIMEOUT, **kw)


def error_of(r: requests.Response) -> dict[str, Any]:
    error = r.json()["error"]
    assert set(error) == OPENAI_ERROR_KEYS, error
    return error


def completion(**overrides: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **overrides}


def chat(**overrides: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hello"}]
    return {"model": TINY_MODEL_NAME, "messages": messages, "max_tokens": 4, **overrides}


# -- /v1/completions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": TINY_CONTEXT + 10}, "max_tokens"),
    ],
)
def test_bad_completion_requests_are_400(
    server: RunningServer, overrides: dict, needle: str
) -> None:
    r = post(server, "/v1/completions", completion(**overrides))
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert needle in error["message"]
    assert error["type"] == "invalid_request_error"


def test_completion_invalid_json_and_missing_prompt_are_400(server: RunningServer) -> None:
    headers = {**server.headers, "Content-Type": "application/json"}
    r = requests.post(
        server.url + "/v1/completions", data=b'{"prompt": ', headers=headers, timeout=TIMEOUT
    )
    assert r.status_code == 400 and "JSON" in error_of(r)["message"], r.text
    r = post(server, "/v1/completions", {"model": TINY_MODEL_NAME, "max_tokens": 4})
    assert r.status_code == 400 and "prompt" in error_of(r)["message"], r.text


def test_completion_lora_adapter_model_name_is_400(server: RunningServer) -> None:
    r = post(server, "/v1/completions", completion(model="gpt-17:adapter"))
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "model" and "LoRA adapter 'adapter'" in error_of(r)["message"]


# -- /v1/chat/completions -------------------------------------------------------------------------


def test_chat_missing_messages_key_is_400(server: RunningServer) -> None:
    r = post(server, "/v1/chat/completions", {"model": TINY_MODEL_NAME, "max_tokens": 4})
    assert r.status_code == 400 and "messages" in error_of(r)["message"], r.text


def test_chat_prompt_longer_than_context_is_400(server: RunningServer) -> None:
    long = " ".join(["hello"] * (TINY_CONTEXT + 10))
    r = post(server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": long}]))
    assert r.status_code == 400, r.text
    assert "context length" in error_of(r)["message"]


# -- /generate ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
    ],
)
def test_bad_generate_sampling_is_400(server: RunningServer, sampling: dict, needle: str) -> None:
    r = post(server, "/generate", {"text": "Hello", "sampling_params": sampling})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_generate_text_longer_than_context_is_400(server: RunningServer) -> None:
    text = " ".join(["hello"] * (TINY_CONTEXT + 10))
    r = post(server, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400, r.text
    assert "context length" in r.json()["error"]["message"]


# -- keys, routes, body size ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 1}}),
        ("/v1/completions", completion()),
        ("/v1/chat/completions", chat()),
    ],
)
@pytest.mark.parametrize("auth", ["Bearer wrong", "", None])
def test_wrong_or_missing_key_on_post_is_401(
    server: RunningServer, path: str, body: dict, auth: str | None
) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    r = post(server, path, body, headers=headers)
    assert r.status_code == 401, r.text
    assert error_of(r)["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/no_such_route"), ("POST", "/generate/extra"), ("GET", "/v1/models/x/y")],
)
def test_unknown_route_is_404(server: RunningServer, method: str, path: str) -> None:
    r = requests.request(method, server.url + path, headers=server.headers, timeout=TIMEOUT)
    assert r.status_code == 404, r.text
    error_of(r)


def test_oversized_generate_body_is_413(server: RunningServer) -> None:
    body = {"text": "a" * (TINY_MAX_BODY_BYTES + 10), "sampling_params": {"max_new_tokens": 1}}
    r = post(server, "/generate", body)
    assert r.status_code == 413, r.text
    assert "limit" in error_of(r)["message"]


def test_oversized_chunked_body_is_413(server: RunningServer) -> None:
    """No Content-Length: the limit is enforced on the bytes received."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(TINY_MAX_BODY_BYTES // (64 << 10) + 2):
            yield b"a" * (64 << 10)
        yield b'", "max_tokens": 1}'

    headers = {**server.headers, "Content-Type": "application/json"}
    r = requests.post(
        server.url + "/v1/completions", data=chunks(), headers=headers, timeout=TIMEOUT
    )
    assert "Content-Length" not in r.request.headers
    assert r.status_code == 413, r.text
    assert "limit" in error_of(r)["message"]


def test_server_still_serves_after_bad_input(server: RunningServer) -> None:
    r = post(server, "/v1/completions", completion(max_tokens=2))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
