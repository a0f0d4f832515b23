"""/v1/messages (the Anthropic Messages API) through the official ``anthropic`` SDK against the
shared tiny-model server on loopback: text answers whole and streamed, a forced tool call
round-tripped (tool_use out, tool_result back in, answered), stop sequences, usage with the
cache split, count_tokens, and bad requests as 4xx in Anthropic's error shape."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
import requests
from server_process import TINY_API_KEY, TINY_CONTEXT, TINY_MODEL_NAME, RunningServer
from weather_tool import QUESTION, WEATHER_SCHEMA

SCHEMA = WEATHER_SCHEMA  # tests/support/weather_tool.py
WEATHER = {"name": "get_weather", "description": "Weather forecast", "input_schema": SCHEMA}
USER = {"role": "user", "content": QUESTION}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    # the SDK sends the key as x-api-key, which the server takes as it takes a bearer token
    return anthropic.Anthropic(
        base_url=server.url, api_key=TINY_API_KEY, timeout=120, max_retries=0
    )


# this SDK's create() has no sampling arguments; the server still reads them from the body
GREEDY = {"extra_body": {"temperature": 0.0}}
SAMPLED = {"extra_body": {"temperature": 1.0}}


def create(client: anthropic.Anthropic, **kw: Any) -> Any:
    args = {"model": TINY_MODEL_NAME, "max_tokens": 12, "messages": [USER], **GREEDY}
    return client.messages.create(**{**args, **kw})


def post(server: RunningServer, path: str, body: Any) -> requests.Response:
    return requests.post(server.url + path, json=body, headers=server.headers, timeout=120)


def test_text_answer_whole_and_streamed_agree(client: anthropic.Anthropic) -> None:
    whole = create(client, system="Answer briefly.", max_tokens=10)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == TINY_MODEL_NAME
    assert whole.id.startswith("msg_")
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    text = "".join(b.text for b in whole.content if b.type == "text")
    usage = whole.usage
    assert usage.output_tokens <= 10 and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens > 0
    args = {"model": TINY_MODEL_NAME, "max_tokens": 10, "messages": [USER], **GREEDY}
    with client.messages.stream(system="Answer briefly.", **args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert [b.text for b in final.content] == [b.text for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == usage.output_tokens
    # the same prompt again: the radix cache holds it, and the usage says so
    prompt = usage.input_tokens + usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert final.usage.cache_read_input_tokens > 0


def test_the_prompt_is_the_chat_routes(client: anthropic.Anthropic, server: RunningServer) -> None:
    """The same conversation through /v1/chat/completions has the same prompt tokens, and
    count_tokens counts them."""
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=TINY_API_KEY, max_retries=0)
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be kind."}]
    messages = [USER, {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]}]
    messages.append({"role": "user", "content": "And tomorrow?"})
    r = create(client, system=system, messages=messages, max_tokens=2)
    prompt = r.usage.input_tokens + r.usage.cache_read_input_tokens
    plain = [
        {"role": "system", "content": "You are terse.\nBe kind."},
        USER,
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    same = chat.chat.completions.create(model=TINY_MODEL_NAME, max_tokens=2, messages=plain)
    assert same.usage.prompt_tokens == prompt
    counted = client.messages.count_tokens(model=TINY_MODEL_NAME, system=system, messages=messages)
    assert counted.input_tokens == prompt


def test_forced_tool_call_round_trip(client: anthropic.Anthropic) -> None:
    choice = {"type": "tool", "name": "get_weather"}
    first = create(client, tools=[WEATHER], tool_choice=choice, max_tokens=120, **SAMPLED)
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, SCHEMA)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}
    turns = [USER, {"role": "assistant", "content": first.content}]
    answer = create(
        client, tools=[WEATHER], messages=[*turns, {"role": "user", "content": [result]}]
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in answer.content)
    # the result is in the prompt: a longer one makes a longer prompt
    longer = {**result, "content": [{"type": "text", "text": "Sunny, 21 C, light wind " * 4}]}
    count = client.messages.count_tokens
    short_n = count(
        model=TINY_MODEL_NAME,
        tools=[WEATHER],
        messages=[*turns, {"role": "user", "content": [result]}],
    )
    long_n = count(
        model=TINY_MODEL_NAME,
        tools=[WEATHER],
        messages=[*turns, {"role": "user", "content": [longer]}],
    )
    assert long_n.input_tokens > short_n.input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == short_n.input_tokens


def test_streamed_tool_call_sends_input_json_deltas(client: anthropic.Anthropic) -> None:
    args = {"model": TINY_MODEL_NAME, "max_tokens": 120, "messages": [USER]}
    with client.messages.stream(**args, tools=[WEATHER], tool_choice={"type": "any"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert deltas and all(isinstance(d, str) for d in deltas)
    assert final.stop_reason == "tool_use"
    (call,) = final.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, SCHEMA)


def test_raw_event_stream_order(server: RunningServer) -> None:
    body = {"model": TINY_MODEL_NAME, "max_tokens": 6, "messages": [USER], "stream": True}
    r = post(server, "/v1/messages", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    body_events = names[2:-2]
    if body_events:  # one text block: start, deltas, stop
        assert body_events[0] == "content_block_start" and body_events[-1] == "content_block_stop"
        assert set(body_events[1:-1]) == {"content_block_delta"}


def test_stop_sequence_ends_the_answer(client: anthropic.Anthropic) -> None:
    free = create(client, max_tokens=16)
    text = "".join(b.text for b in free.content if b.type == "text")
    word = re.search("[A-Za-z]{2,}", text[1:])  # the random model writes odd text: cut in a word
    if word is None:
        pytest.skip(f"the random model's greedy answer has no word to cut at: {text!r}")
    stop = word.group()
    r = create(client, max_tokens=16, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"messages": [USER]}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [USER], "temperature": 1.5}, "temperature"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0]",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [USER],
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "nope",
        ),  # fmt: skip
        ({"max_tokens": 4, "messages": [USER], "tool_choice": {"type": "maybe"}}, "tool_choice"),
        (
            {
                "max_tokens": 4,
                "messages": [USER],
                "tools": [{"type": "web_search_20250305", "name": "web", "input_schema": {}}],
            },
            "tools[0]",
        ),  # fmt: skip
    ],
)
def test_bad_requests_are_400s_in_anthropics_shape(
    server: RunningServer, body: dict[str, Any], reason: str
) -> None:
    r = post(server, "/v1/messages", {"model": TINY_MODEL_NAME, **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert reason in error["error"]["message"]


def test_sdk_errors_and_authentication(client: anthropic.Anthropic, server: RunningServer) -> None:
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        create(client, max_tokens=0)
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        create(wrong)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_a_stream_that_fails_ends_with_an_error_event(server: RunningServer) -> None:
    """A forced call whose schema the grammar backend refuses fails once the request is queued
    (the stream has started): the stream ends with Anthropic's error event."""
    bad = {**WEATHER, "input_schema": {"type": "strin"}}
    body = {"model": TINY_MODEL_NAME, "max_tokens": 8, "messages": [USER], "stream": True,
            "tools": [bad], "tool_choice": {"type": "any"}}  # fmt: skip
    r = post(server, "/v1/messages", body)
    assert r.status_code == 200
    events = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert events == ["message_start", "ping", "error"], r.text
    last = json.loads(r.text.strip().splitlines()[-1].removeprefix("data: "))
    assert last["error"]["type"] == "invalid_request_error" and "strin" in last["error"]["message"]
    client = anthropic.Anthropic(base_url=server.url, api_key=TINY_API_KEY, max_retries=0)
    with pytest.raises(anthropic.APIError, match="strin"):
        with client.messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
            list(s)


def test_max_tokens_is_a_bound_up_to_the_context(client: anthropic.Anthropic) -> None:
    """Agent clients send a large max_tokens with every request: past the context it is not a
    400, the answer ends at the context with stop_reason max_tokens."""

    def turn(k: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "hello " * k}]

    def count(k: int) -> int:
        return client.messages.count_tokens(model=TINY_MODEL_NAME, messages=turn(k)).input_tokens

    base, per = count(0), (count(200) - count(100)) / 100
    k = int((TINY_CONTEXT - 30 - base) / per)
    prompt = count(k)
    assert 0 < TINY_CONTEXT - prompt <= 60, prompt
    r = create(client, max_tokens=10**6, messages=turn(k), extra_body={"ignore_eos": True})
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == TINY_CONTEXT - prompt
