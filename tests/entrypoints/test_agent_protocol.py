"""The agent APIs' pieces without a server: Anthropic Messages and OpenAI Responses bodies as
the chat requests they amount to, the block order of a streamed answer, the response store's
bounds. (Over HTTP: test_http_anthropic.py, test_http_responses.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.entrypoints.anthropic_protocol import MessagesRequest
from radixserve.entrypoints.anthropic_protocol import chat_request as messages_chat
from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import DeltaToolCall, FunctionCall
from radixserve.entrypoints.output_blocks import BlockSequence
from radixserve.entrypoints.responses_protocol import ResponsesRequest, input_messages
from radixserve.entrypoints.responses_protocol import chat_request as responses_chat
from radixserve.entrypoints.responses_store import ResponseStore

TOOL = {"name": "f", "input_schema": {"type": "object"}}


def messages(**kw: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **kw})


def test_messages_become_the_chat_conversation() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42", "is_error": True}
    body = messages(
        system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "calling"}, call,
            ]},
            {"role": "user", "content": [result, {"type": "text", "text": "go on"}]},
        ],
        stop_sequences=["END"], top_k=3,
    )  # fmt: skip
    chat = messages_chat(body)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "f", "arguments": '{"x": 1}'}}
        ]},
        {"role": "tool", "content": "Error: 42", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "go on"},
    ]  # fmt: skip
    assert (chat.max_tokens, chat.stop, chat.top_k) == (5, ["END"], 3)


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}, True),
    ],
)
def test_tool_choice_maps_to_the_chat_routes(choice: Any, chat_choice: Any, parallel: bool) -> None:
    chat = messages_chat(messages(messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                                  tool_choice=choice))  # fmt: skip
    assert (chat.tool_choice, chat.parallel_tool_calls) == (chat_choice, parallel)
    assert chat.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]


def test_a_tool_result_in_an_assistant_turn_is_refused() -> None:
    result = {"type": "tool_result", "tool_use_id": "t", "content": "x"}
    with pytest.raises(ApiError, match=r"messages\[0\].content\[0\]"):
        messages_chat(messages(messages=[{"role": "assistant", "content": [result]}]))


def test_responses_input_items_become_the_chat_conversation() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ]
    out = input_messages(items)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in out[2]["tool_calls"]] == ["c1", "c2"]  # one turn's calls together
    body = ResponsesRequest(input="next", instructions="be brief", max_output_tokens=7)
    chat = responses_chat(body, [*out, *input_messages(body.input)])
    assert chat.messages[0].role == "system" and chat.messages[0].content == "be brief"
    assert chat.messages[-1].content == "next" and chat.max_tokens == 7


def test_block_sequence_orders_reasoning_text_and_calls() -> None:
    seq = BlockSequence()
    call = DeltaToolCall(index=0, id="call_1", type="function",
                         function=FunctionCall(name="f", arguments='{"a"'))  # fmt: skip
    more = DeltaToolCall(index=0, function=FunctionCall(arguments=": 1}"))
    events = seq.feed("think", "", []) + seq.feed("", "say", [call]) + seq.feed("", "", [more])
    events += seq.close()
    trace = [(e.type, e.block.kind, e.delta) for e in events]
    assert trace == [
        ("start", "reasoning", ""), ("delta", "reasoning", "think"), ("stop", "reasoning", ""),
        ("start", "text", ""), ("delta", "text", "say"), ("stop", "text", ""),
        ("start", "tool_call", ""), ("delta", "tool_call", '{"a"'),
        ("delta", "tool_call", ": 1}"), ("stop", "tool_call", ""),
    ]  # fmt: skip
    assert [b.index for b in seq.blocks] == [0, 1, 2] and seq.called
    assert seq.blocks[2].arguments() == {"a": 1} and seq.blocks[2].call_id == "call_1"


def test_response_store_is_bounded_oldest_first() -> None:
    store = ResponseStore(max_entries=2, max_chars=100)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 10}])
    assert store.get("r0") is None and len(store) == 2
    store.get("r1")  # used: kept longer than r2
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 90}])
    assert store.get("r2") is None and store.get("r1") is not None and store.chars == 100
    store.put({"id": "huge"}, [{"role": "user", "content": "z" * 500}])  # alone over the bound
    assert len(store) == 1 and store.get("huge") is not None
    assert store.pop("huge") is not None and store.chars == 0
    assert store.get("missing") is None
