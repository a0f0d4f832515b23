"""The OpenAI-compatible routes, through the official ``openai`` client, against a real server."""

from __future__ import annotations

import openai
import pytest
import requests
from server_process import (
    TINY_API_KEY,
    TINY_CONTEXT,
    TINY_MAX_BODY_BYTES,
    TINY_MODEL_NAME,
    RunningServer,
)

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=60, max_retries=0
    )


def chat(client: openai.OpenAI, **kw):  # type: ignore[no-untyped-def]
    args = {"model": TINY_MODEL_NAME, "messages": MESSAGES, "max_tokens": 12, **GREEDY, **kw}
    return client.chat.completions.create(**args)


def complete(client: openai.OpenAI, **kw):  # type: ignore[no-untyped-def]
    args = {
        "model": TINY_MODEL_NAME,
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        **GREEDY,
        **kw,
    }
    return client.completions.create(**args)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [TINY_MODEL_NAME]


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = chat(client)
    assert r.object == "chat.completion" and r.model == TINY_MODEL_NAME
    assert len(r.choices) == 1 and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.choices[0].message.content  # greedy tiny-model text is never empty in 12 tokens


def test_chat_stream_equals_non_stream_and_ends_with_usage(client: openai.OpenAI) -> None:
    whole = chat(client).choices[0].message.content
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    r = complete(client)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12


def test_n2_gives_two_choices(client: openai.OpenAI) -> None:
    r = chat(client, n=2, temperature=1.0, seed=7, max_tokens=8)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    chunks = list(complete(client, n=2, temperature=1.0, seed=7, max_tokens=8, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert set(texts) == {0, 1} and all(texts.values())


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    a = complete(client, temperature=1.0, seed=123).choices[0].text
    b = complete(client, temperature=1.0, seed=123).choices[0].text
    assert a == b


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    full = complete(client, max_tokens=24).choices[0].text
    candidates = [ch for ch in full[1:] if ch.isalnum()]
    assert candidates, f"no usable stop character in {full!r}"
    stop = candidates[0]
    expected = full[: full.index(stop)]
    r = complete(client, max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == expected
    streamed = complete(client, max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = chat(client, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = complete(client, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completion_echo_with_logprobs_scores_the_prompt(
    client: openai.OpenAI, server: RunningServer
) -> None:
    """How scoring clients (lm-eval's loglikelihood) read a text's likelihood: echo=True,
    logprobs, max_tokens=0. Every prompt token comes back with its logprob (the first has
    none), equal to the native API's prompt logprobs."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = requests.post(
        server.url + "/tokenize", json={"text": prompt}, headers=server.headers, timeout=60
    ).json()
    native = requests.post(
        server.url + "/generate",
        json={"input_ids": ids["tokens"], "sampling_params": {"max_new_tokens": 0},
              "return_logprob": True, "logprob_start_len": 0},
        headers=server.headers, timeout=60,
    ).json()  # fmt: skip
    want = [e[0] for e in native["meta_info"]["input_token_logprobs"]]
    r = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids["tokens"]) == len(lp.token_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and want[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-5)
    assert all(p <= 0 for p in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # With generated tokens: the prompt's entries, then the output's, as without echo.
    plain = complete(client, prompt=prompt, max_tokens=4, logprobs=1).choices[0]
    both = complete(client, prompt=prompt, max_tokens=4, echo=True, logprobs=1).choices[0]
    assert both.text == prompt + plain.text
    n = len(ids["tokens"])
    assert both.logprobs.tokens[n:] == plain.logprobs.tokens
    assert both.logprobs.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs)
    assert both.logprobs.text_offset[n] == len(prompt)
    with pytest.raises(openai.BadRequestError, match="stream=false"):
        complete(client, prompt=prompt, echo=True, logprobs=1, stream=True)


def test_completion_echo_keeps_special_tokens_in_line_with_the_logprobs(
    client: openai.OpenAI,
) -> None:
    """The echo is the prompt as its tokens spell it, special tokens included: the text and
    the logprob tokens and offsets agree (they once dropped "<|im_start|>" from the text)."""
    prompt = "<|im_start|>user hi"
    r = complete(client, prompt=prompt, max_tokens=1, echo=True, logprobs=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and lp.tokens[0] == "<|im_start|>"
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset)
    assert [choice.text[o:] for o in lp.text_offset] == [
        "".join(lp.tokens[i:]) for i in range(len(lp.tokens))
    ]
    ids = complete(client, prompt=[1, 2], max_tokens=0, echo=True).choices[0]
    assert ids.text == "<|im_start|><|im_end|>"


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "def add(a, b): return a + b. " * 6}]
    first = chat(client, messages=messages, max_tokens=2)
    second = chat(client, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 20
    assert second.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": TINY_CONTEXT + 10}, "max_tokens"),
        ({"max_completion_tokens": TINY_CONTEXT + 10}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_chat_requests_are_400(client: openai.OpenAI, overrides: dict, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, **overrides)
    assert needle in exc.value.message
    assert exc.value.body["type"] == "invalid_request_error"


def test_prompt_longer_than_context_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="context length"):
        complete(client, prompt=[5] * (TINY_CONTEXT + 1), max_tokens=1)


def test_any_model_name_is_served_by_default(client: openai.OpenAI) -> None:
    # As SGLang: its bench client sends the tokenizer path as "model". Strict mode (404) is
    # tested in test_openai_fields.py.
    r = chat(client, model="gpt-17")
    assert r.model == TINY_MODEL_NAME and r.choices[0].message.content
    assert complete(client, model="/some/tokenizer/path").model == TINY_MODEL_NAME


def test_a_lora_adapter_in_the_model_name_is_400(client: openai.OpenAI) -> None:
    # SGLang reads "base:adapter" as a LoRA request; this server has no adapters.
    with pytest.raises(openai.BadRequestError, match="LoRA adapter 'my-adapter'") as e:
        chat(client, model=f"{TINY_MODEL_NAME}:my-adapter")
    assert e.value.body["param"] == "model"


def test_wrong_api_key_is_401(server: RunningServer) -> None:
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert requests.get(server.url + "/v1/models", timeout=30).status_code == 401


def _post(server: RunningServer, path: str, data: bytes) -> requests.Response:
    headers = {**server.headers, "Content-Type": "application/json"}
    return requests.post(server.url + path, data=data, headers=headers, timeout=60)


def test_raw_http_errors_use_the_openai_error_shape(server: RunningServer) -> None:
    cases = [
        ("/v1/chat/completions", b"{not json", 400, "JSON"),
        ("/v1/chat/completions", b'{"model": "tiny-llama"}', 400, "messages"),
        ("/v1/completions", b"[1, 2]", 400, "object"),
        ("/v1/no/such/route", b"{}", 404, "route"),
        (
            "/v1/completions",
            b'{"prompt": "' + b"a" * (TINY_MAX_BODY_BYTES + 10) + b'"}',
            413,
            "limit",
        ),
    ]
    for path, data, status, needle in cases:
        r = _post(server, path, data)
        assert r.status_code == status, (path, r.text[:300])
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert needle in error["message"], error
    # and the server still serves
    ok = _post(server, "/v1/completions", b'{"prompt": "Hello", "max_tokens": 2}')
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
