"""OpenAI request fields SGLang's clients send (issue 21), through the official ``openai`` client
and the native /generate: strict model names, max_completion_tokens, logit_bias, stop_regex and
suffix (fill-in-the-middle).

The shared tiny server covers most of it; one more tiny server, whose vocabulary has FIM tokens
and which runs with ``--strict-model-name``, covers strict names and ``suffix``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests
from server_process import (
    TINY_API_KEY,
    TINY_MODEL_NAME,
    RunningServer,
    start_server,
    stop_server,
    tiny_server_args,
)
from tiny_models import make_tiny_llama_dir

FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
PROMPT = "The quick brown fox"
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=60, max_retries=0
    )


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A tiny Llama whose tokenizer also has StarCoder's FIM tokens, served strictly."""
    from tokenizers import Tokenizer

    out = make_tiny_llama_dir(tmp_path_factory.mktemp("fim-llama"), vocab_size=512)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(list(FIM))  # ids past the trained ones, inside the model's 512
    tok.save(str(out / "tokenizer.json"))
    log = tmp_path_factory.mktemp("fim-server") / "server.log"
    running = start_server(
        [*tiny_server_args(out), "--strict-model-name"], log, TINY_API_KEY, timeout=300
    )
    yield running
    assert stop_server(running) == 0, running.log()[-4000:]


def fim_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=60, max_retries=0
    )


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    args = {"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, **GREEDY, **kw}
    return client.completions.create(**args)


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    messages = [{"role": "user", "content": PROMPT}]
    args = {"model": TINY_MODEL_NAME, "messages": messages, "max_tokens": 12, **GREEDY, **kw}
    return client.chat.completions.create(**args)


def generate(server: RunningServer, **params: Any) -> dict[str, Any]:
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "ignore_eos": True, **params}}
    r = requests.post(server.url + "/generate", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_text(chunks: Any, chat_stream: bool = False) -> tuple[str, str | None]:
    text, finish = "", None
    for c in chunks:
        for choice in c.choices:
            text += (choice.delta.content or "") if chat_stream else choice.text
            finish = choice.finish_reason or finish
    return text, finish


# -- model names ---------------------------------------------------------------------------------


def test_strict_model_name_refuses_unknown_names(fim_server: RunningServer) -> None:
    client = fim_client(fim_server)
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        complete(client, model="gpt-17")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    for name in (TINY_MODEL_NAME, "default"):  # the served name and "default" still work
        assert complete(client, model=name, max_tokens=1).model == TINY_MODEL_NAME


# -- max_completion_tokens -----------------------------------------------------------------------


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    extra = {"max_completion_tokens": 4}
    r = complete(client, extra_body={**GREEDY["extra_body"], **extra})  # max_tokens 12 too
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    chunks = complete(
        client,
        extra_body={**GREEDY["extra_body"], **extra},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chunks)
    assert streamed_text(chunks)[0] == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 4
    assert chat(client, max_completion_tokens=3).usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        complete(client, extra_body={"max_completion_tokens": 10**6})


# -- logit_bias ----------------------------------------------------------------------------------


def test_logit_bias_forces_a_token_greedy_and_sampled(
    client: openai.OpenAI, server: RunningServer
) -> None:
    forced = 42
    native = generate(server, max_new_tokens=5, logit_bias={str(forced): 100})
    assert native["output_ids"] == [forced] * 5
    for temperature in (0.0, 1.0):
        r = complete(client, max_tokens=5, temperature=temperature, logit_bias={forced: 100})
        assert r.choices[0].text == native["text"]
        text, _ = streamed_text(
            complete(
                client, max_tokens=5, temperature=temperature, logit_bias={forced: 100}, stream=True
            )
        )
        assert text == native["text"]
    c = chat(client, max_tokens=5, temperature=1.0, logit_bias={str(forced): 100})
    assert c.choices[0].message.content == native["text"]


def test_logit_bias_minus_100_bans_the_greedy_token(
    client: openai.OpenAI, server: RunningServer
) -> None:
    first = generate(server, max_new_tokens=1)["output_ids"][0]
    banned = generate(server, max_new_tokens=6, logit_bias={str(first): -100})
    assert banned["output_ids"][0] != first and first not in banned["output_ids"]
    r = complete(client, max_tokens=6, logit_bias={str(first): -100})
    assert r.choices[0].text == banned["text"]


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"100000": 1}, "token ids"),
        ({"hello": 1}, "token ids"),
        ({"5": 101}, r"\[-100.0, 100.0\]"),
    ],
)
def test_bad_logit_bias_is_400_naming_it(
    client: openai.OpenAI, server: RunningServer, bias: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=message) as e:
        complete(client, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias"
    body = {"text": PROMPT, "sampling_params": {"logit_bias": bias}}
    r = requests.post(server.url + "/generate", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400 and re.search(message, r.text), r.text


# -- stop_regex ----------------------------------------------------------------------------------


def test_stop_regex_stops_at_the_match_and_keeps_it(
    client: openai.OpenAI, server: RunningServer
) -> None:
    full = generate(server, max_new_tokens=24)["text"]
    target = full[8:11]  # a 3-character piece of the greedy output
    pattern = re.escape(target[0]) + "." + re.escape(target[2])
    end = re.search(pattern, full).end()  # type: ignore[union-attr]
    want = full[:end]
    native = generate(server, max_new_tokens=24, stop_regex=pattern)
    assert native["text"] == want
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    r = complete(client, max_tokens=24, extra_body={"stop_regex": [pattern], "ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    stream = complete(
        client, max_tokens=24, stream=True, extra_body={"stop_regex": pattern, "ignore_eos": True}
    )
    assert streamed_text(stream) == (want, "stop")


def test_invalid_stop_regex_is_400(client: openai.OpenAI, server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError, match="not a valid regular expression") as e:
        complete(client, extra_body={"stop_regex": "(unclosed"})
    assert e.value.body["param"] == "stop_regex"
    with pytest.raises(openai.BadRequestError, match="not a valid regular expression"):
        chat(client, extra_body={"stop_regex": ["ok", "[z-a]"]})
    body = {"text": PROMPT, "sampling_params": {"stop_regex": "*"}}
    r = requests.post(server.url + "/generate", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400 and "stop_regex" in r.text, r.text


# -- suffix (fill-in-the-middle) -----------------------------------------------------------------


def test_suffix_builds_the_fill_in_the_middle_prompt(fim_server: RunningServer) -> None:
    client = fim_client(fim_server)
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    r = complete(client, prompt=prefix, suffix=suffix, max_tokens=8)
    literal = f"{FIM[0]}{prefix}{FIM[1]}{suffix}{FIM[2]}"
    same = complete(client, prompt=literal, max_tokens=8)
    assert r.usage.prompt_tokens == same.usage.prompt_tokens
    assert r.choices[0].text == same.choices[0].text

    def count(text: str) -> int:
        url, headers = fim_server.url + "/tokenize", fim_server.headers
        return requests.post(url, json={"prompt": text}, headers=headers, timeout=30).json()[
            "count"
        ]

    assert [count(marker) for marker in FIM] == [1, 1, 1]  # special tokens, not their spelling
    assert count(literal) == r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="text prompt") as e:
        complete(client, prompt=[5, 6, 7], suffix=suffix)
    assert e.value.body["param"] == "suffix"


def test_suffix_without_fim_tokens_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="no fill-in-the-middle tokens") as e:
        complete(client, suffix="\nreturn x")
    assert e.value.body["param"] == "suffix"
    assert complete(client, suffix="").usage.completion_tokens == 12  # empty: plain completion
