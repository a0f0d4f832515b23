"""The malformed-input battery: kinds of bad request, ten variants each, as raw HTTP bodies.

Each case is ``(path, body bytes)``; every one must be answered 4xx in the OpenAI error format.
"""

from __future__ import annotations

import json
from typing import Any

from server_process import TINY_MODEL_NAME

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSGS = [{"role": "user", "content": "hi"}]
Case = tuple[str, bytes]


def chat(**kw: Any) -> Case:
    return CHAT, json.dumps({"model": TINY_MODEL_NAME, "messages": MSGS, **kw}).encode()


def comp(**kw: Any) -> Case:
    return COMP, json.dumps({"model": TINY_MODEL_NAME, "prompt": "hi", **kw}).encode()


def gen(**sampling: Any) -> Case:
    return GEN, json.dumps({"text": "hi", "sampling_params": sampling}).encode()


def raw(path: str, text: str) -> Case:
    return path, text.encode()


def tool(function: Any) -> Case:
    return chat(tools=[{"type": "function", "function": function}], tool_choice="required")


def _nested(depth: int, open_: str, close: str, leaf: str = "1") -> str:
    return open_ * depth + leaf + close * depth


_CHAT_BODY = json.dumps({"model": TINY_MODEL_NAME, "messages": MSGS, "max_tokens": 4})

CASES: dict[str, list[Case]] = {
    "bad_types": [
        chat(messages="hello"),
        chat(max_tokens="ten"),
        chat(temperature="hot"),
        chat(n=1.5),
        chat(stream="yes please"),
        chat(stop=5),
        comp(prompt={"text": "hi"}),
        comp(max_tokens=[1]),
        gen(max_new_tokens="many"),
        gen(temperature=[0.5]),
    ],
    "missing_fields": [
        raw(CHAT, "{}"),
        raw(COMP, "{}"),
        raw(GEN, "{}"),
        raw(CHAT, json.dumps({"model": TINY_MODEL_NAME})),
        raw(COMP, json.dumps({"model": TINY_MODEL_NAME, "max_tokens": 3})),
        raw(GEN, json.dumps({"sampling_params": {"max_new_tokens": 3}})),
        chat(messages=[{"content": "hi"}]),
        chat(messages=[]),
        comp(prompt=[]),
        raw(GEN, json.dumps({"input_ids": []})),
    ],
    "out_of_range": [
        chat(temperature=-1),
        chat(top_p=0),
        chat(top_p=1.5),
        chat(max_tokens=-1),
        chat(presence_penalty=5),
        comp(frequency_penalty=-5),
        comp(seed=-(2**63) - 1),  # int64 takes -1 (OpenAI), not past it
        comp(logprobs=21),
        gen(min_p=2.0),
        chat(max_tokens=10**9),
    ],
    "huge_n": [
        chat(n=10**6),
        chat(n=129),
        chat(n=17),
        comp(n=2**63),
        comp(n=0),
        comp(n=-1),
        gen(n=1000),
        gen(n=17),
        gen(n=0),
        chat(n=1e9),
    ],
    "huge_stop_lists": [
        chat(stop=["x"] * 17),
        chat(stop=["x"] * 10_000),
        chat(stop=["y" * 300]),
        comp(stop=["z" * 100_000]),
        comp(stop=[str(i) for i in range(100)]),
        gen(stop=["x"] * 1000),
        gen(stop="s" * 5000),
        gen(stop_token_ids=list(range(1000))),
        chat(stop=[""]),
        comp(stop=[1, 2]),
    ],
    "nul_bytes": [
        raw(CHAT, _CHAT_BODY.replace('"model"', '"mo\x00del"', 1).replace("{", "{\x00", 1)),
        raw(CHAT, "\x00" + _CHAT_BODY),
        raw(CHAT, _CHAT_BODY + "\x00"),
        raw(CHAT, _CHAT_BODY.replace(":", ":\x00", 1)),
        raw(COMP, '{"prompt": "hi"\x00}'),
        raw(COMP, "\x00\x00\x00\x00"),
        raw(GEN, '{"text": \x00"hi"}'),
        raw(GEN, '{"text": "hi", \x00 "sampling_params": {}}'),
        chat(messages=[{"role": "us\x00er", "content": "hi"}]),
        chat(model=TINY_MODEL_NAME + "\x00"),
    ],
    "invalid_utf8": [
        (CHAT, b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        (CHAT, b"\xff\xfe\xfd"),
        (CHAT, b'{"messages": "\xc0\xaf"}'),
        (COMP, b'{"prompt": "\xed\xa0\x80"}'),
        (COMP, b'{"prompt": "\xf8\x88\x80\x80\x80"}'),
        (COMP, b'{"prompt": "ok", "stop": ["\x80"]}'),
        (GEN, b'{"text": "\xe2\x28\xa1"}'),
        (GEN, b'{"text": "a\xc3"}'),
        (GEN, b'{"text": "\\ud800 escaped lone surrogate"}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "model": "\\ud800"}'),
    ],
    "deeply_nested_json": [
        raw(CHAT, _nested(10_000, "[", "]")),
        raw(COMP, _nested(5_000, '{"a":', "}")),
        raw(GEN, _nested(2_000, "[", "]")),
        raw(CHAT, '{"messages": ' + _nested(3_000, "[", "]") + "}"),
        raw(COMP, '{"prompt": ' + _nested(1_000, "[", "]", '"x"') + "}"),
        raw(GEN, '{"text": "hi", "sampling_params": ' + _nested(2_000, '{"a":', "}") + "}"),
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "n",
                    "schema": (
                        json.loads(
                            _nested(200, '{"type": "array", "items": ', "}", '{"type": "bogus"}')
                        )
                    ),
                },
            }
        ),
        raw(CHAT, '{"tools": ' + _nested(2_500, "[", "]") + "}"),
        raw(GEN, '{"input_ids": ' + _nested(3_000, "[", "]") + "}"),
        raw(COMP, _nested(100_000, "[", "]")),
        # deep inside free-form fields the OpenAI routes' models accept as they are
        chat(chat_template_kwargs={"a": json.loads(_nested(600, "[", "]"))}),
        tool(
            {"name": "f", "parameters": {"type": "object", "x": json.loads(_nested(600, "[", "]"))}}
        ),
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {
                                "name": "f",
                                "arguments": json.loads(_nested(600, "[", "]")),
                            },
                        }
                    ],
                },
            ]
        ),
    ],
    "invalid_schemas": [
        chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": 5}}),
        chat(response_format={"type": "json_schema"}),
        chat(response_format={"type": "bogus"}),
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}),
        chat(response_format="json"),
        gen(json_schema="{not json"),
        gen(json_schema='{"type": "nonsense"}'),
        gen(json_schema='{"properties": 3}'),
        gen(json_schema='{"$ref": "#/definitions/missing"}'),
        comp(json_schema={"type": "object", "required": "yes"}),
    ],
    "invalid_regexes": [
        gen(regex="("),
        gen(regex="["),
        gen(regex="a{2,1}"),
        gen(regex="(?<"),
        gen(regex="*"),
        gen(regex="a)"),
        comp(regex="(unclosed"),
        comp(regex="[z-a]"),
        chat(regex="+"),
        chat(regex="\\"),
    ],
    "unknown_roles": [
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        chat(messages=[{"role": "", "content": "hi"}]),
        chat(messages=[{"role": "root", "content": "hi"}]),
        chat(messages=[{"role": "USERS", "content": "hi"}]),
        chat(messages=[{"role": 5, "content": "hi"}]),
        chat(messages=[{"role": None, "content": "hi"}]),
        chat(messages=[{"role": ["user"], "content": "hi"}]),
        chat(messages=[{"role": {"r": 1}, "content": "hi"}]),
        chat(messages=[{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]),
        chat(messages=[{"role": "assistant2", "content": "hi"}]),
    ],
    "non_json_schema_tools": [
        tool({"name": "f", "parameters": "a string"}),
        tool({"name": "f", "parameters": 5}),
        tool({"name": "f", "parameters": {"type": "bogus"}}),
        tool({"name": "f", "parameters": {"type": "object", "properties": 7}}),
        tool({"name": "f", "parameters": {"type": "object", "required": "x"}}),
        tool({"parameters": {"type": "object"}}),
        tool({"name": "", "parameters": {"type": "object"}}),
        chat(tools="all of them"),
        chat(tools=[5]),
        chat(tools=[{"type": "bogus"}]),
    ],
    "logit_bias": [  # token ids outside the tiny vocabulary (384), biases outside [-100, 100]
        chat(logit_bias={"1": 100.5}),
        chat(logit_bias={"50256": -100}),
        chat(logit_bias={str(i): 1 for i in range(1000)}),
        chat(logit_bias="everything"),
        chat(logit_bias=[1, 2]),
        comp(logit_bias={"1": -1e9}),
        comp(logit_bias={"x": "y"}),
        comp(logit_bias={str(i): -1 for i in range(100_000)}),
        comp(logit_bias=5),
        chat(logit_bias={"1": "lots"}),
    ],
}
