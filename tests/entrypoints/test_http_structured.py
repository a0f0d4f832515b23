"""Structured outputs over HTTP (shared tiny-model server, default grammar backend): OpenAI
response_format and tools, native sampling_params constraints, and bad grammars as 400s."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
import requests
from server_process import TINY_API_KEY, TINY_MODEL_NAME, RunningServer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather forecast", "parameters": SCHEMA},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=120, max_retries=0
    )


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    args = {"model": TINY_MODEL_NAME, "messages": MESSAGES, "max_tokens": 120, **kw}
    return client.chat.completions.create(**args)


def generate(server: RunningServer, **body: Any) -> requests.Response:
    return requests.post(server.url + "/generate", json=body, headers=server.headers, timeout=120)


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    r = chat(client, response_format=fmt, temperature=1.0, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_take_response_format(client: openai.OpenAI) -> None:
    """As SGLang's and vLLM's /v1/completions do (it was ignored: free text came back)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    r = client.completions.create(
        model=TINY_MODEL_NAME, prompt="The weather:", max_tokens=200, temperature=1.0, n=2,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_a_whitespace_regex_is_a_grammar(server: RunningServer) -> None:
    """Only "" is refused: a regex of one space or newline is valid (both were 400s)."""
    for regex in (" ", "\n"):
        r = generate(server, text="Hello", sampling_params={"max_new_tokens": 4, "regex": regex})
        assert r.status_code == 200, r.text
        assert r.json()["text"] == regex, r.json()


def test_response_format_json_object(client: openai.OpenAI) -> None:
    r = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_named_tool_choice_forces_a_valid_call(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_required_tool_choice_streams_the_call_as_deltas(client: openai.OpenAI) -> None:
    chunks = list(chat(client, tools=[WEATHER, TIME], tool_choice="required", stream=True))
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    # one call: a first delta with its id and name, then argument fragments
    assert {d.index for d in deltas} == {0} and deltas[0].id.startswith("call_")
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    name = deltas[0].function.name
    arguments = "".join(d.function.arguments or "" for d in deltas)
    params = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}[name]
    jsonschema.validate(json.loads(arguments), params)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.delta.content for ch in chunks for c in ch.choices)


def test_tool_choice_none_and_auto_answer_in_text(client: openai.OpenAI) -> None:
    for tool_choice in ("none", "auto"):
        r = chat(client, tools=[WEATHER], tool_choice=tool_choice, max_tokens=8, temperature=0)
        assert r.choices[0].message.tool_calls is None  # the random model writes no call


def test_native_generate_with_regex_and_schema_object(server: RunningServer) -> None:
    regex = r"[0-9]{3}-[a-z]{2,4}"
    params = {"regex": regex, "max_new_tokens": 16, "temperature": 1.0}
    out = generate(server, text=["Hello", "The quick"], sampling_params=params).json()
    assert all(re.fullmatch(regex, o["text"]) for o in out), out
    params = {"json_schema": SCHEMA, "max_new_tokens": 64, "temperature": 0}
    one = generate(server, text="Hello", sampling_params=params).json()
    jsonschema.validate(json.loads(one["text"]), SCHEMA)


def test_dead_end_is_an_abort_with_a_message(server: RunningServer) -> None:
    params = {"regex": "ab", "min_new_tokens": 4, "max_new_tokens": 8, "temperature": 0}
    out = generate(server, text="Hello", sampling_params=params).json()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "grammar dead end" in reason["message"]


@pytest.mark.parametrize("stop", [{"stop": "def"}, {"stop_regex": "d.f"}])
def test_a_stop_inside_the_text_a_grammar_forces_ends_it_there(
    server: RunningServer, stop: dict[str, str]
) -> None:
    """The regex forces all of its text (jump-forward appends it before the first step); a
    stop string inside it ends the output there, with no text or tokens after it."""
    params = {"regex": "abc def ghi jkl", "max_new_tokens": 60, **stop}
    out = generate(server, text="x", sampling_params=params).json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    kept = "abc " if "stop" in stop else "abc def"  # a stop string is cut, a regex's match kept
    assert out["text"] == kept, out
    ids = requests.post(
        server.url + "/tokenize", json={"text": "abc def"}, headers=server.headers, timeout=60
    ).json()["tokens"]
    assert len(out["output_ids"]) <= len(ids), out  # no tokens from past the stop


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"json_schema": '{"type": "object", "properties": {"a": {"type": "strin"}}}'}, "strin"),
        ({"json_schema": "{not json"}, "JSON"),
        ({"regex": "(ab"}, "parenthesis"),
        ({"ebnf": 'root ::= "a" undefined_rule'}, "undefined_rule"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "give at most one of"),
        ({"stop_regex": "(x"}, "not a valid regular expression"),
    ],
)
def test_bad_grammar_is_a_400_naming_it(
    server: RunningServer, params: dict[str, Any], problem: str
) -> None:
    r = generate(server, text="Hello", sampling_params={"max_new_tokens": 4, **params})
    assert r.status_code == 400, r.text
    assert problem in r.json()["error"]["message"]
    ok = generate(server, text="Hello", sampling_params={"max_new_tokens": 2})
    assert ok.status_code == 200  # still serving


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format type 'yaml' is not supported"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "schema must be"),
        ({"tools": [WEATHER], "tool_choice": {"function": {"name": "nope"}}}, "names 'nope'"),
        ({"tools": [{"type": "function"}]}, "tools[0] must be"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"function": ["f"]}}, "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "either response_format or a forced tool_choice",
        ),
        ({"extra_body": {"regex": "(ab"}}, "parenthesis"),
        # a second constraint was dropped silently (the response_format or tool call won)
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"regex": "[a-z]+"}},
            "give either regex or response_format",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "extra_body": {"json_schema": "{}"}},
            "give either json_schema or response_format",
        ),
    ],
)
def test_bad_chat_structure_is_a_400(
    client: openai.OpenAI, kw: dict[str, Any], problem: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, max_tokens=4, **kw)
    assert problem in str(err.value)


def test_stream_with_a_bad_schema_fails_before_streaming(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}
    with pytest.raises(openai.APIError) as err:
        list(chat(client, response_format=bad, stream=True))
    assert "strin" in str(err.value)
