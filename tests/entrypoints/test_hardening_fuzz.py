"""Issue 13's fuzz test: bodies for /generate, /v1/completions, /v1/chat/completions, /tokenize
and /abort_request built from each route's fields (the OpenAI models, PROTOCOL.md's native
fields), every field now and then replaced by a value of the wrong type, out of range, huge or
deeply nested, sent over one keep-alive connection to a real server. No response may be a 5xx
(every error an OpenAI error object), the engine must not die, and afterwards no live request,
KV slot or cache lock may be left (the server also runs with --debug-leak-check).

Bounded for a 2-core CI machine: RADIXSERVE_EDGE_FUZZ_EXAMPLES per route (default 60), requests
cut at 1 s (--request-timeout), grammar compiles at 2 s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hardening import assert_openai_error, is_idle, own_server, wait_idle
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from server_process import TINY_MODEL_NAME, RunningServer

EXAMPLES = int(os.environ.get("RADIXSERVE_EDGE_FUZZ_EXAMPLES", "60"))

pytestmark = pytest.mark.slow  # its own server

# -- values -------------------------------------------------------------------------------------

EDGE_INTS = [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 2**70]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_INTS),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 1e-320, 0.5, -0.0]),
    st.text(max_size=20),
    st.sampled_from(["", "yes", "true", "1", "\u0000", "\ud800", "x" * 5000]),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
deep = st.integers(1, 400).map(lambda d: json.loads("[" * d + "1" + "]" * d))
wrong = st.one_of(junk, deep, st.lists(st.integers(), min_size=1000, max_size=2000))


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value, sometimes anything at all."""
    return st.one_of(valid, valid, wrong)


small = st.integers(0, 4)
prob = st.floats(0, 1)
stop = st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4)))
ids = st.lists(st.integers(0, 383), min_size=1, max_size=8)
schema = st.sampled_from(
    [
        '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
        '{"type": "string", "maxLength": 5}',
        '{"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": '
        '{"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}}}',
        "{not json",
    ]
)
regex = st.sampled_from(["[0-9]{1,3}", "(yes|no)", "(", "a{2,1}", "x*"])

SAMPLING = {
    "max_new_tokens": small,
    "min_new_tokens": small,
    "temperature": st.floats(0, 2),
    "top_p": prob,
    "top_k": st.integers(-1, 500),
    "min_p": prob,
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "stop": stop,
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "sampling_seed": st.integers(0, 2**64 - 1),
    "seed": st.integers(0, 2**64 - 1),
    "n": st.integers(1, 2),
    "logprobs": st.booleans(),
    "top_logprobs_num": small,
    "json_schema": schema,
    "regex": regex,
    "ebnf": st.sampled_from(['root ::= "a" | "b"', 'root ::= "a" root', "root ::="]),
}
OPENAI = {
    "model": st.sampled_from([TINY_MODEL_NAME, "default"]),
    "max_tokens": small,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "n": st.integers(1, 2),
    "stop": stop,
    "seed": st.integers(0, 2**64 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=8),
    "top_k": st.integers(-1, 500),
    "min_p": prob,
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": small,
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=3),
    "no_stop_trim": st.booleans(),
    "json_schema": schema,
    "regex": regex,
}


def body(fields: dict[str, st.SearchStrategy[Any]], required: tuple[str, ...] = ()) -> Any:
    """An object with some of ``fields`` (``required`` ones most of the time): all valid, or
    one of them wrong, or many wrong, plus now and then an unknown field; or not an object."""

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True))
        names += [n for n in required if draw(st.integers(0, 9)) > 0 and n not in names]
        out = {n: draw(fields[n]) for n in names}
        mode = draw(st.sampled_from(["valid", "valid", "one wrong", "one wrong", "chaos"]))
        if mode == "one wrong" and names:
            out[draw(st.sampled_from(names))] = draw(wrong)
        elif mode == "chaos":
            out = {n: draw(field(fields[n])) for n in names}
        if draw(st.integers(0, 9)) == 0:
            out[draw(st.text(max_size=10))] = draw(junk)
        return out

    return st.one_of(build(), build(), build(), build(), build(), build(), build(), wrong)


def _maybe(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


words = st.text(min_size=1, max_size=10)
NATIVE = {
    "text": st.one_of(words, st.lists(words, min_size=1, max_size=3)),
    "sampling_params": st.one_of(body(SAMPLING), st.lists(body(SAMPLING), min_size=1, max_size=2)),
    "stream": st.booleans(),
    "rid": st.text(min_size=1, max_size=12),
    "return_logprob": st.booleans(),
    "logprob_start_len": st.integers(-1, 10),
    "top_logprobs_num": small,
    "return_text_in_logprobs": st.booleans(),
}
NATIVE_IDS = {
    **{k: v for k, v in NATIVE.items() if k != "text"},
    "input_ids": st.one_of(ids, st.lists(ids, min_size=1, max_size=3)),
}
COMPLETIONS = {
    **OPENAI,
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3), ids),
    "logprobs": small,
    "echo": st.booleans(),
    "best_of": st.integers(1, 2),
    "suffix": st.text(max_size=4),
    "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(-1, 1), max_size=2),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)},
    optional={"name": st.text(min_size=1, max_size=5)},
)
CHAT = {
    **OPENAI,
    "messages": st.lists(message, min_size=1, max_size=3),
    "max_completion_tokens": small,
    "logprobs": st.booleans(),
    "top_logprobs": small,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "bogus"])}),
        schema.map(
            lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": _maybe(s)}}
        ),
    ),
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": st.text(min_size=1, max_size=5), "parameters": schema.map(_maybe)}
                ),
            }
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(["auto", "none", "required", "bogus"]),
}
TOKENIZE = {
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3)),
    "text": st.text(max_size=30),
    "add_special_tokens": st.booleans(),
}
ABORT = {"rid": st.text(max_size=12), "abort_all": st.booleans()}


ROUTES = {
    "/generate": st.one_of(body(NATIVE, ("text",)), body(NATIVE_IDS, ("input_ids",))),
    "/v1/completions": body(COMPLETIONS, ("model", "prompt")),
    "/v1/chat/completions": body(CHAT, ("model", "messages")),
    "/tokenize": body(TOKENIZE, ("prompt",)),
    "/abort_request": body(ABORT),
}

# -- the test -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("edge-fuzz") / "server.log"
    flags = ["--request-timeout", "1", "--grammar-compile-timeout", "2"]
    with own_server(tiny_long_llama_dir, log, *flags) as running:
        yield running


def _check(response: httpx.Response, sent: Any) -> None:
    where = f"{json.dumps(sent, default=str)[:600]} -> {response.status_code}"
    assert response.status_code < 500, f"{where}: {response.text[:600]}"
    if response.status_code >= 400:
        assert_openai_error(response, range(400, 500))
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), f"{where}: {response.text[-300:]}"


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_fuzzed_bodies_never_5xx(fuzzed: RunningServer, route: str) -> None:
    headers = {**fuzzed.headers, "Content-Type": "application/json"}
    with httpx.Client(base_url=fuzzed.url, headers=headers, timeout=60) as client:

        @given(sent=ROUTES[route])
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
        )
        def run(sent: Any) -> None:
            # allow_nan: Python's json writes NaN/Infinity literals, which must be a 400 too.
            content = json.dumps(sent, allow_nan=True).encode("utf-8", "surrogatepass")
            _check(client.post(route, content=content), sent)

        run()
    assert fuzzed.proc.poll() is None, fuzzed.log()[-3000:]


def test_after_the_fuzz_nothing_is_left(fuzzed: RunningServer) -> None:
    state = wait_idle(fuzzed, timeout=60)
    assert is_idle(state), state
    health = httpx.get(fuzzed.url + "/health_generate", headers=fuzzed.headers, timeout=60)
    assert health.status_code == 200, health.text
    assert fuzzed.proc.poll() is None, fuzzed.log()[-3000:]
