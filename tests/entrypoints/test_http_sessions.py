"""Agent traffic over HTTP: /open_session and /close_session, ``session_params`` on /generate
(SGLang's: the session's context goes first) and on the OpenAI routes (extra body: the
session keeps the conversation pinned), ``priority`` and its metrics. A private server with
--enable-priority-scheduling and --debug-leak-check (pins are no leak; locks beyond them are)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hardening import metric, own_server, server_state, wait_idle
from server_process import TINY_API_KEY, TINY_MODEL_NAME, RunningServer

pytestmark = pytest.mark.slow  # a server of its own

FLAGS = ("--enable-priority-scheduling", "--session-pin-ratio", "0.5")


@pytest.fixture(scope="module")
def agent_server(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("sessions") / "server.log"
    with own_server(tiny_long_llama_dir, log, *FLAGS) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=120)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def turn(server: RunningServer, new: list[int], **body: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    response = post(server, "/generate", {"input_ids": new, "sampling_params": sampling, **body})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_generate_turns_continue_the_session_from_its_cache(agent_server: RunningServer) -> None:
    opened = post(agent_server, "/open_session", {"capacity_of_str_len": 4096})
    assert opened.status_code == 200, opened.text
    sid = opened.json()
    assert isinstance(sid, str) and sid
    context = 0
    for i in range(4):
        out = turn(agent_server, ids(i, 20), session_params={"id": sid}, rid=f"{sid}-{i}")
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == context + 20
        if i:  # all of the previous turn but its last sampled token (never fed: no KV)
            assert meta["cached_tokens"] == context - 1, meta
        context += 20 + meta["completion_tokens"]
    # continue from turn 1's prompt only (drop its output), cut at its first 10 tokens
    params = {"id": sid, "rid": f"{sid}-1", "offset": 10, "drop_previous_output": True}
    out = turn(agent_server, ids(9, 5), session_params=params)
    assert out["meta_info"]["prompt_tokens"] == 15
    state = wait_idle(agent_server, 60)
    assert state["sessions"]["open_sessions"] == 1
    assert state["kv"]["locked"] == state["kv"]["pinned"] == state["sessions"]["pinned_tokens"] > 0
    assert post(agent_server, "/close_session", {"session_id": sid}).status_code == 200
    state = server_state(agent_server)
    assert state["kv"]["locked"] == state["kv"]["pinned"] == 0
    assert state["sessions"]["open_sessions"] == 0


def test_unknown_sessions_are_400s_naming_the_id(agent_server: RunningServer) -> None:
    sampling = {"max_new_tokens": 2}
    body = {"input_ids": [5, 6], "sampling_params": sampling, "session_params": {"id": "gone"}}
    response = post(agent_server, "/generate", body)
    assert response.status_code == 400 and "unknown session 'gone'" in response.text
    response = post(agent_server, "/close_session", {"session_id": "gone"})
    assert response.status_code == 400 and "unknown session 'gone'" in response.text
    body["session_params"] = {"id": "x", "bogus": 1}
    response = post(agent_server, "/generate", body)
    assert response.status_code == 400 and "bogus" in response.text
    post(agent_server, "/open_session", {"session_id": "twice"})
    response = post(agent_server, "/open_session", {"session_id": "twice"})
    assert response.status_code == 400 and "'twice' is already open" in response.text
    assert post(agent_server, "/close_session", {"session_id": "twice"}).status_code == 200


def test_openai_chat_in_a_session_keeps_the_conversation_cached(
    agent_server: RunningServer,
) -> None:
    client = openai.OpenAI(
        base_url=agent_server.url + "/v1", api_key=TINY_API_KEY, timeout=60, max_retries=0
    )
    sid = post(agent_server, "/open_session", {}).json()
    messages: list[dict[str, str]] = []
    extra = {"session_params": {"id": sid}, "ignore_eos": True, "priority": 3}
    previous_prompt = 0
    for i in range(3):
        messages.append({"role": "user", "content": f"turn {i}: " + "tell me more " * 8})
        reply = client.chat.completions.create(
            model=TINY_MODEL_NAME, messages=messages, max_tokens=5, temperature=0.0,
            extra_body=extra,
        )  # fmt: skip
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        if i:
            assert usage.prompt_tokens_details.cached_tokens >= previous_prompt
        previous_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    with pytest.raises(openai.BadRequestError, match="applies to /generate only"):
        client.chat.completions.create(
            model=TINY_MODEL_NAME, messages=messages, max_tokens=2,
            extra_body={"session_params": {"id": sid, "offset": 3}},
        )  # fmt: skip
    assert post(agent_server, "/close_session", {"session_id": sid}).status_code == 200
    assert metric(agent_server, "radixserve_priority_admitted_requests", priority="3") >= 3


def test_priority_must_be_an_integer(agent_server: RunningServer) -> None:
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}, "priority": "high"}
    response = post(agent_server, "/generate", body)
    assert response.status_code == 400 and "priority must be an integer" in response.text
    body["priority"] = -4
    assert post(agent_server, "/generate", body).status_code == 200
    assert metric(agent_server, "radixserve_priority_admitted_requests", priority="-4") == 1
