"""--tool-call-parser: every format on recorded-style model outputs, whole and streamed in
awkward pieces (the stream must add up to the whole response), then over HTTP with the
official openai client (the tiny model's output forced with a regex), parallel_tool_calls
true and false."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import openai
import pytest
from server_process import TINY_API_KEY, TINY_MODEL_NAME, RunningServer

from radixserve.entrypoints.server_args import parse_server_args
from radixserve.entrypoints.tool_parsers import TOOL_PARSERS, ToolStream, get_tool_parser

NESTED = {"query": 'café "Zürich" 東京 🌧', "filters": {"tags": ["a", "b"], "range": [1, {"to": 2}]}}
NESTED_JSON = json.dumps(NESTED, ensure_ascii=False)

# (parser, output as the model family writes it, content, [(name, arguments object)])
CASES: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    (  # Qwen2.5: text first, two parallel calls, nested arguments with unicode
        "qwen25",
        "I'll look both up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"location": "San Francisco, CA", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "arguments": ' + NESTED_JSON + "}\n"
        "</tool_call>",
        "I'll look both up.",
        [("get_weather", {"location": "San Francisco, CA", "unit": "c"}), ("search", NESTED)],
    ),
    (  # Hermes: a call between two sentences; braces and an escaped quote inside a string
        "hermes",
        'Sure.<tool_call>{"name": "note", "arguments": {"text": "a } ] \\" {"}}</tool_call> Done.',
        "Sure. Done.",
        [("note", {"text": 'a } ] " {'})],
    ),
    (  # Llama 3.1 with its python tag, two calls separated by ';'
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris"}}; '
        '{"name": "search", "parameters": ' + NESTED_JSON + "}",
        "",
        [("get_weather", {"location": "Paris"}), ("search", NESTED)],
    ),
    (  # Llama 3.2 without the tag: the whole output is the call
        "llama3",
        '{"name": "get_weather", "parameters": {"location": "Paris", "days": 3}}',
        "",
        [("get_weather", {"location": "Paris", "days": 3})],
    ),
    (  # Mistral v0.3: text, then the JSON array of calls
        "mistral",
        'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "search", "arguments": ' + NESTED_JSON + "}]",
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("search", NESTED)],
    ),
    (  # newer Mistral templates: compact calls
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]' + NESTED_JSON,
        "",
        [("get_weather", {"city": "Paris"}), ("search", NESTED)],
    ),
    (  # another key order: the call is read whole (arguments re-encoded)
        "hermes",
        '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "hermes",
        "No tools needed: 2 < 3 and {x} is fine.",
        "No tools needed: 2 < 3 and {x} is fine.",
        [],
    ),  # noqa: E501
    ("llama3", "Paris is sunny today.", "Paris is sunny today.", []),
    ("mistral", "Just text [with brackets].", "Just text [with brackets].", []),
]
# Malformed calls: nothing crashes and the text stays in the content.
MALFORMED = [
    ("hermes", 'Hm <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}'),  # cut short
    ("hermes", '<tool_call>["not", "a", "call"]</tool_call>'),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"'),
    ("llama3", '{"city": "Paris"}'),  # JSON, but no name
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }]'),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{oops}"),
]


def stream(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[Any]]:
    """Feed ``pieces``; (content, [(name, arguments)] by index, every delta)."""
    s = ToolStream(get_tool_parser(parser))
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, new = s.feed(piece, i == len(pieces) - 1)
        content += text
        deltas += new
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ["", ""])
        if d.id is not None:
            assert call == ["", ""] and d.type == "function"  # the header comes first, once
            call[0] = d.function.name
        call[1] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], deltas


def splits(text: str, seed: int) -> list[list[str]]:
    """One character at a time, then random cuts."""
    rng = random.Random(seed)
    out = [list(text)]
    for _ in range(15):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse_whole_output(parser: str, text: str, content: str, calls: list[Any]) -> None:
    got_content, got = get_tool_parser(parser).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_stream_in_any_pieces_equals_the_whole(
    parser: str, text: str, content: str, calls: list[Any]
) -> None:
    whole = [(c.name, c.arguments) for c in get_tool_parser(parser).parse(text)[1]]
    for pieces in splits(text, seed=len(text)):
        got_content, got, deltas = stream(parser, pieces)
        assert (got_content, got) == (content, whole), pieces
    # char by char, a name-first call's arguments arrive in fragments
    _, _, deltas = stream(parser, list(text))
    if calls and '"arguments": {"city": "Oslo"}, "name"' not in text:
        assert len(deltas) > 2 * len(calls)


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_call_stays_in_the_content(parser: str, text: str) -> None:
    assert get_tool_parser(parser).parse(text) == (text.strip(), [])
    for pieces in splits(text, seed=1):
        content, _, _ = stream(parser, pieces)
        assert content == text.strip()  # streamed: the text still arrives, nothing crashes


def test_deeply_nested_arguments_do_not_crash() -> None:
    text = (
        '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    )
    assert get_tool_parser("hermes").parse(text) == (text, [])
    third = len(text) // 3
    content, calls, _ = stream("hermes", [text[:third], text[third : 2 * third], text[2 * third :]])
    assert (content, calls) == (text, [])


def test_content_stops_before_a_call_and_holds_back_a_partial_marker() -> None:
    s = ToolStream(get_tool_parser("mistral"))
    assert s.feed("Checking ", False) == ("Checking", [])  # trailing space held: may be cut
    assert s.feed("[TOOL_", False) == ("", [])
    content, deltas = s.feed('CALLS] [{"name": "f", "arguments": {"x": 1}}]', False)
    assert content == "" and deltas[0].function.arguments == '{"x": 1}'  # type: ignore[union-attr]
    # the rest of the content comes with the last update: "Checking" + " " + " Bye"
    assert s.feed(" Bye", True) == ("  Bye", [])
    s = ToolStream(get_tool_parser("llama3"))
    assert s.feed("<|python", False) == ("", [])
    _, deltas = s.feed('_tag|>{"name": "f", "parameters": {"x"', False)
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [  # type: ignore[union-attr]
        (0, "f", '{"x"')
    ]


def test_unknown_parser_names_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; available: hermes"):
        get_tool_parser("nope")
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit):
            parse_server_args([flag, "nope"])
        err = capsys.readouterr().err
        assert f"{flag} 'nope' is unknown; available:" in err
    assert {"hermes", "qwen25", "llama3", "mistral"} <= set(TOOL_PARSERS)
    assert parse_server_args(["--tool-call-parser", "mistral"]).tool_call_parser == "mistral"


# -- over HTTP --------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# The parser server also splits reasoning (qwen3): the output opens with its think block.
LLAMA_OUTPUT = (
    "<think>Two cities.</think>Checking. "
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}; '
    '{"name": "get_weather", "parameters": {"city": "Lima"}}'
)
HERMES_OUTPUT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
    "</tool_call>"
)


def client_of(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=120, max_retries=0
    )


def forced_chat(client: openai.OpenAI, output: str, **kw: Any) -> Any:
    """A chat request whose output is exactly ``output`` (a regex forces it)."""
    extra = {"regex": re.escape(output), **kw.pop("extra_body", {})}
    return client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=[{"role": "user", "content": "Weather in Zürich and Lima?"}],
        tools=[WEATHER],
        max_tokens=400,
        temperature=0,
        extra_body=extra,
        **kw,
    )


def streamed(chunks: Any) -> tuple[str, list[tuple[str, str]], list[str | None]]:
    """(content, [(name, arguments)] by index, finish reasons) of a stream."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.reasoning_content:
                assert content == ""  # reasoning comes before the content
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", ""])
                call[0] += d.function.name or ""
                call[1] += d.function.arguments or ""
            reasons.append(choice.finish_reason)
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], reasons


@pytest.mark.parametrize("parallel", [True, False])
def test_http_llama3_calls_whole_and_streamed(parser_server: RunningServer, parallel: bool) -> None:
    client = client_of(parser_server)
    body = {"extra_body": {"parallel_tool_calls": parallel}}
    r = forced_chat(client, LLAMA_OUTPUT, **body)
    choice = r.choices[0]
    cities = ["Zürich", "Lima"] if parallel else ["Zürich"]
    assert choice.finish_reason == "tool_calls", choice
    assert (choice.message.reasoning_content, choice.message.content) == (
        "Two cities.",
        "Checking.",
    )
    calls = choice.message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == cities
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    content, got, reasons = streamed(forced_chat(client, LLAMA_OUTPUT, stream=True, **body))
    assert content == "Checking."
    assert got == [(c.function.name, c.function.arguments) for c in calls]
    assert reasons[-1] == "tool_calls"


def test_http_default_parser_is_hermes(server: RunningServer) -> None:
    client = client_of(server)
    r = forced_chat(client, HERMES_OUTPUT)
    assert r.choices[0].message.content == "Checking."
    assert [c.function.arguments for c in r.choices[0].message.tool_calls] == [
        '{"city": "Zürich"}',
        '{"city": "Lima"}',
    ]
    content, got, _ = streamed(forced_chat(client, HERMES_OUTPUT, stream=True))
    assert (content, [a for _, a in got]) == (
        "Checking.",
        ['{"city": "Zürich"}', '{"city": "Lima"}'],
    )
    assert r.choices[0].message.reasoning_content is None  # no --reasoning-parser here


def test_http_bad_parallel_tool_calls_is_a_400(server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
        forced_chat(client_of(server), "x", extra_body={"parallel_tool_calls": "no"})
