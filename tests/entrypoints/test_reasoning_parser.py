"""--reasoning-parser: the <think> split on DeepSeek-R1 and Qwen3 style outputs, whole and
streamed in awkward pieces (the stream adds up to the whole), then over HTTP with the official
openai client: reasoning_content in messages and deltas, chat_template_kwargs reaching the
template (enable_thinking), separate_reasoning and stream_reasoning."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import anthropic
import openai
import pytest
from server_process import TINY_API_KEY, TINY_MODEL_NAME, RunningServer

from radixserve.entrypoints.reasoning import REASONING_PARSERS, ReasoningSplit, split_reasoning

R1 = REASONING_PARSERS["deepseek-r1"]
QWEN3 = REASONING_PARSERS["qwen3"]
THOUGHT = "The user asks 2+2. <b>Simple</b>: 4 — no </thin trap.\n"

# (format, forced, output, reasoning, content)
CASES = [
    # DeepSeek-R1: the template opened the block; the output starts inside it
    (R1, True, THOUGHT + "</think>\n\nThe answer is 4.", THOUGHT, "\n\nThe answer is 4."),
    # DeepSeek-R1-0528 writes the opening tag itself
    (R1, True, "<think>" + THOUGHT + "</think>The answer is 4.", THOUGHT, "The answer is 4."),
    # cut short inside the block: all reasoning
    (R1, True, "Let me think about 東京", "Let me think about 東京", ""),
    # Qwen3 thinking
    (QWEN3, True, "<think>\n" + THOUGHT + "</think>\n\n4", "\n" + THOUGHT, "\n\n4"),
    # Qwen3 opening a tool call without closing the block: the call is content
    (
        QWEN3,
        True,
        "<think>Call it.<tool_call>{}</tool_call>",
        "Call it.",
        "<tool_call>{}</tool_call>",
    ),
    # Qwen3 with enable_thinking=false: not forced, no block in the output
    (QWEN3, False, "The answer is 4. </think> stays", None, "The answer is 4. </think> stays"),
    (QWEN3, False, "  <think>x</think>y", "x", "y"),
    (QWEN3, True, "", None, ""),
]


def streamed(split: ReasoningSplit, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in pieces:
        r, c = split.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("fmt", "forced", "text", "reasoning", "content"), CASES)
def test_split_whole_and_streamed(
    fmt: Any, forced: bool, text: str, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(fmt, forced, text) == (reasoning, content)
    rng = random.Random(len(text))
    ways = [list(text)]
    for _ in range(15):
        cuts = sorted(
            rng.sample(range(1, len(text)), max(0, min(len(text) - 1, rng.randint(0, 9))))
        )
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in ways:
        assert streamed(ReasoningSplit(fmt, forced), pieces) == (reasoning or "", content)


def test_partial_tags_are_held_back_and_stream_reasoning_false_waits() -> None:
    split = ReasoningSplit(R1, forced=True)
    assert split.feed("<thi") == ("", "")  # maybe the opening tag
    assert split.feed("nk>abc</th") == ("abc", "")  # maybe the closing tag
    assert split.feed("ink>ok") == ("", "ok")
    held = ReasoningSplit(R1, forced=True, stream_reasoning=False)
    assert held.feed("a") == ("", "") and held.feed("b") == ("", "")
    assert held.feed("</think>c") == ("ab", "c")


def test_qwen3_is_forced_unless_enable_thinking_is_false() -> None:
    assert QWEN3.forced(None) and QWEN3.forced({"enable_thinking": True})
    assert not QWEN3.forced({"enable_thinking": False})
    assert R1.forced({"enable_thinking": False})


# -- over HTTP (tests/entrypoints/conftest.py parser_server: --reasoning-parser qwen3, and a
# template that closes an empty think block when enable_thinking is false) -------------------


@pytest.fixture(scope="module")
def client(parser_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=parser_server.url + "/v1", api_key=TINY_API_KEY, timeout=120, max_retries=0
    )


def forced_chat(client: openai.OpenAI, output: str, **extra: Any) -> Any:
    """A chat request whose output is exactly ``output`` (a regex forces it)."""
    stream = extra.pop("stream", False)
    return client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=200,
        temperature=0,
        stream=stream,
        extra_body={"regex": re.escape(output), **extra},
    )


OUTPUT = "<think>2+2 is 4.</think>The answer is 4."


def test_http_reasoning_content_whole_and_streamed(client: openai.OpenAI) -> None:
    message = forced_chat(client, OUTPUT).choices[0].message
    assert (message.reasoning_content, message.content) == ("2+2 is 4.", "The answer is 4.")
    reasoning = content = ""
    for chunk in forced_chat(client, OUTPUT, stream=True):
        for choice in chunk.choices:
            reasoning += choice.delta.reasoning_content or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("2+2 is 4.", "The answer is 4.")


def test_http_enable_thinking_false_reaches_the_template(client: openai.OpenAI) -> None:
    on = forced_chat(client, "4")
    off = forced_chat(client, "4", chat_template_kwargs={"enable_thinking": False})
    # the template rendered the empty think block: a longer prompt
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    # thinking on: the output starts inside the block; off: it is the answer
    assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == ("4", None)
    assert (off.choices[0].message.reasoning_content, off.choices[0].message.content) == (None, "4")


def test_http_separate_and_stream_reasoning_off(client: openai.OpenAI) -> None:
    message = forced_chat(client, OUTPUT, separate_reasoning=False).choices[0].message
    assert (message.reasoning_content, message.content) == (None, OUTPUT)
    deltas = [
        c.delta.reasoning_content
        for chunk in forced_chat(client, OUTPUT, stream=True, stream_reasoning=False)
        for c in chunk.choices
        if c.delta.reasoning_content
    ]
    assert deltas == ["2+2 is 4."]  # in one piece, when the block ended


@pytest.mark.parametrize("bad", [{"separate_reasoning": "no"}, {"chat_template_kwargs": [1]}])
def test_http_bad_fields_are_400(client: openai.OpenAI, bad: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError, match=next(iter(bad))):
        forced_chat(client, "x", **bad)


NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": NO_ARGS}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_http_forced_tool_choice_is_a_call_not_reasoning(
    client: openai.OpenAI, choice: Any
) -> None:
    """A forced tool_choice's grammar makes the whole output the call: qwen3's parser, which
    takes an output as opening inside a think block, must not turn it into reasoning."""
    kw: dict[str, Any] = {
        "model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "Call f."}],
        "tools": TOOLS, "tool_choice": choice, "max_tokens": 200, "temperature": 0,
    }  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.reasoning_content is None
    assert [c.function.name for c in whole.message.tool_calls or []] == ["f"]
    names, reasoning = [], ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning += c.delta.reasoning_content or ""
            names += [t.function.name for t in c.delta.tool_calls or [] if t.function.name]
    assert (names, reasoning) == (["f"], "")


@pytest.mark.parametrize("stream", [False, True])
def test_http_response_format_is_content_not_reasoning(client: openai.OpenAI, stream: bool) -> None:
    """A JSON response_format makes the output JSON from its first token: with qwen3's parser
    (which takes an output as opening inside a think block) it was all reasoning_content."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    answer = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "ok?"}], max_tokens=200,
        temperature=0, response_format=fmt, stream=stream,  # type: ignore[arg-type]
    )  # fmt: skip
    if stream:
        deltas = [c.delta for chunk in answer for c in chunk.choices]
        content = "".join(d.content or "" for d in deltas)
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    else:
        message = answer.choices[0].message
        content, reasoning = message.content or "", message.reasoning_content or ""
    assert reasoning == "" and isinstance(json.loads(content)["ok"], bool), (content, reasoning)


# -- the agent APIs: reasoning as a thinking block (/v1/messages) or a reasoning item
# (/v1/responses), whole and streamed ----------------------------------------------------------


def test_http_messages_thinking_block(parser_server: RunningServer) -> None:
    client = anthropic.Anthropic(
        base_url=parser_server.url, api_key=TINY_API_KEY, timeout=120, max_retries=0
    )
    kw: dict[str, Any] = {
        "model": TINY_MODEL_NAME, "max_tokens": 200,
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "extra_body": {"temperature": 0, "regex": re.escape(OUTPUT)},
    }  # fmt: skip
    whole = client.messages.create(**kw)
    blocks = [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content
    ]
    assert blocks == [("thinking", "2+2 is 4."), ("text", "The answer is 4.")]
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thinking = "".join(
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    assert thinking == "2+2 is 4." and [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "The answer is 4."


def test_http_responses_reasoning_item(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": TINY_MODEL_NAME, "input": "What is 2+2?", "max_output_tokens": 200,
        "temperature": 0, "extra_body": {"regex": re.escape(OUTPUT)},
    }  # fmt: skip
    whole = client.responses.create(**kw)
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert (
        whole.output[0].content[0].text == "2+2 is 4." and whole.output_text == "The answer is 4."
    )
    events = list(client.responses.create(**kw, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("2+2 is 4.", "The answer is 4.")
