"""/v1/responses (the OpenAI Responses API) through the official ``openai`` SDK's ``responses``
client against the shared tiny-model server on loopback: text answers whole and streamed, a
forced function call round-tripped (function_call out, function_call_output back in, answered)
both with explicit input items and with ``previous_response_id``, the response store (GET,
DELETE, store=false, unknown ids) and bad requests as 4xx naming the field."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import requests
from server_process import TINY_API_KEY, TINY_MODEL_NAME, RunningServer
from weather_tool import QUESTION, WEATHER_SCHEMA

SCHEMA = WEATHER_SCHEMA  # tests/support/weather_tool.py
WEATHER = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=120, max_retries=0
    )


def create(client: openai.OpenAI, **kw: Any) -> Any:
    args = {"model": TINY_MODEL_NAME, "input": QUESTION, "max_output_tokens": 10}
    return client.responses.create(**{**args, "temperature": 0.0, **kw})


def prompt_tokens(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> int:
    """The prompt of ``messages`` as the chat route renders it."""
    r = client.chat.completions.create(model=TINY_MODEL_NAME, messages=messages, max_tokens=1, **kw)
    return int(r.usage.prompt_tokens)


def test_text_answer_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    whole = create(client, instructions="Answer briefly.")
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.model == TINY_MODEL_NAME
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
        assert whole.usage.output_tokens == 10
    (item,) = whole.output
    assert item.type == "message" and item.role == "assistant"
    plain = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": QUESTION},
    ]
    assert whole.usage.input_tokens == prompt_tokens(client, plain)
    events = list(create(client, instructions="Answer briefly.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt, cached
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # kept too


def test_forced_function_call_round_trip(client: openai.OpenAI) -> None:
    first = create(
        client, tools=[WEATHER], tool_choice=FORCED, max_output_tokens=120, temperature=1.0
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    # the whole conversation sent again as items ...
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        output,
    ]  # fmt: skip
    answer = create(client, input=items, tools=[WEATHER], max_output_tokens=4)
    assert [o.type for o in answer.output] in ([], ["message"])
    # ... or continued from the stored response: the same prompt
    continued = create(
        client, input=[output], previous_response_id=first.id, tools=[WEATHER], max_output_tokens=4
    )
    assert continued.usage.input_tokens == answer.usage.input_tokens
    assert continued.previous_response_id == first.id
    chat_call = {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
    chat = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    assert answer.usage.input_tokens == prompt_tokens(client, chat, tools=tools)


def test_streamed_function_call(client: openai.OpenAI) -> None:
    events = list(
        create(client, tools=[WEATHER], tool_choice="required", max_output_tokens=120, stream=True)
    )
    kinds = [e.type for e in events]
    assert "response.output_item.added" in kinds and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), SCHEMA)
    (call,) = events[-1].response.output
    assert call.type == "function_call" and call.arguments == done.arguments


def test_previous_response_id_carries_the_conversation(client: openai.OpenAI) -> None:
    first = create(client, instructions="Be brief.", max_output_tokens=6)
    second = create(client, input="And tomorrow?", previous_response_id=first.id)
    # instructions do not carry over (OpenAI's rule); the first answer does
    chat = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert second.usage.input_tokens == prompt_tokens(client, chat)
    fetched = client.responses.retrieve(second.id)
    assert fetched.id == second.id and fetched.output_text == second.output_text
    third = create(client, input="And then?", previous_response_id=second.id, max_output_tokens=1)
    assert third.usage.input_tokens > second.usage.input_tokens


def test_store_false_and_unknown_ids(client: openai.OpenAI) -> None:
    unstored = create(client, store=False, max_output_tokens=2)
    assert unstored.store is False
    for make in (
        lambda: client.responses.retrieve(unstored.id),
        lambda: create(client, previous_response_id=unstored.id),
        lambda: create(client, previous_response_id="resp_nope"),
    ):
        with pytest.raises(openai.NotFoundError, match="resp_") as e:
            make()
        assert e.value.status_code == 404
    kept = create(client, max_output_tokens=2)
    deleted = client.responses.delete(kept.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError, match=kept.id):
        client.responses.retrieve(kept.id)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({}, "input"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
         "'x'"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens=1000000"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "not JSON"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s(server: RunningServer, body: dict[str, Any], reason: str) -> None:
    r = requests.post(
        server.url + "/v1/responses",
        json={"model": TINY_MODEL_NAME, **body},
        headers=server.headers,
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and reason in error["message"], error


def test_a_stream_that_fails_ends_with_an_error_event(client: openai.OpenAI) -> None:
    """A schema the grammar backend refuses fails once the request is queued, after
    response.created: an error event, which the SDK raises."""
    r = requests.post(
        client.base_url.join("responses").__str__(),
        json={"model": TINY_MODEL_NAME, "input": "x", "stream": True, "text": bad_format()},
        headers={"Authorization": f"Bearer {TINY_API_KEY}"},
        timeout=60,
    )
    events = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert r.status_code == 200 and events[0] == "response.created" and events[-1] == "error"
    with pytest.raises(openai.APIError, match="strin"):
        list(create(client, text=bad_format(), stream=True))


def bad_format() -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "w", "schema": {"type": "strin"}}}
