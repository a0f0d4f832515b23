"""The tool plan (tool_choice, parallel_tool_calls), the default Hermes parser whole and
streamed, and the tool prompt (no server). Every format: test_tool_parsers.py."""

from __future__ import annotations

import json

import pytest

from radixserve.entrypoints.openai_protocol import ChatCompletionRequest
from radixserve.entrypoints.tool_calls import ToolPlan, plan_tools
from radixserve.entrypoints.tool_parsers import Call, HermesParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'
)


def request(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_hermes_parses_every_block_and_keeps_the_rest() -> None:
    content, calls = HermesParser().parse(TEXT)
    assert content == "Let me check."
    assert calls == [
        Call("get_weather", '{"city": "Paris"}'),
        Call("get_weather", '{"city": "Lima"}'),
    ]


def test_a_broken_block_stays_in_the_content() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert HermesParser().parse(text) == (text, [])


def test_stream_holds_back_a_partial_tag_and_streams_arguments() -> None:
    stream = plan_tools(request(tools=[WEATHER])).stream()
    pieces = [TEXT[i : i + 7] for i in range(0, len(TEXT), 7)]
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, new = stream.feed(piece, i == len(pieces) - 1)
        assert "<" not in text  # nothing of a tag leaks into the content
        content += text
        deltas += new
    assert content == "Let me check."
    heads = [d for d in deltas if d.id is not None]
    assert [(d.index, d.type, d.function.name) for d in heads] == [  # type: ignore[union-attr]
        (0, "function", "get_weather"),
        (1, "function", "get_weather"),
    ]
    assert len({d.id for d in heads}) == 2
    assert len(deltas) > 4  # the arguments came in fragments
    args = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in (0, 1)]  # type: ignore[union-attr]
    assert [json.loads(a)["city"] for a in args] == ["Paris", "Lima"]


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel: bool) -> None:
    plan = plan_tools(request(tools=[WEATHER], parallel_tool_calls=parallel))
    content, calls = plan.parse(TEXT)
    assert content == "Let me check."
    cities = ["Paris", "Lima"] if parallel else ["Paris"]
    assert [json.loads(c.function.arguments)["city"] for c in calls] == cities
    stream = plan.stream()
    deltas = [d for ch in TEXT for d in stream.feed(ch, False)[1]] + stream.feed("", True)[1]
    assert sorted({d.index for d in deltas}) == list(range(len(cities)))


def test_forced_call_is_the_whole_output() -> None:
    plan = plan_tools(request(tools=[WEATHER], tool_choice="required"))
    assert plan.forced_schema is not None
    schema = json.loads(plan.forced_schema)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    stream = plan.stream()
    assert stream.feed('{"name": "get_weather", ', False) == ("", [])
    content, calls = stream.feed('"arguments": {"city": "Oslo"}}', True)
    assert content == "" and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert calls[0].function.arguments == '{"city": "Oslo"}'  # type: ignore[union-attr]


def test_tools_prompt_for_a_template_without_tools() -> None:
    plan = plan_tools(request(tools=[WEATHER]))
    messages = plan.prompt_messages([{"role": "user", "content": "hi"}], "{{ messages }}")
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert '"get_weather"' in messages[0]["content"]
    assert plan.prompt_messages([{"role": "user", "content": "hi"}], "{{ tools }}")[0]["role"] == (
        "user"
    )
    earlier = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}],
    }
    (rendered,) = ToolPlan([]).prompt_messages([earlier], "")
    assert rendered["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("choice", [None, "none"])
def test_no_tools_or_none_turns_tools_off(choice: str | None) -> None:
    tools = [WEATHER] if choice else None
    assert not plan_tools(request(tools=tools, tool_choice=choice)).active
