"""Valid requests that vLLM or SGLang serve, served the same way here: an assistant prefill
(continue_final_message), add_generation_prompt false, negative seeds, JSON nulls for nullable
fields, SGLang's matched_stop and per-chunk usage (continuous_usage_stats)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import requests
from server_process import TINY_API_KEY, TINY_MODEL_NAME, RunningServer

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
USER = {"role": "user", "content": "Count from 1 to 10."}
PREFILL = {"role": "assistant", "content": "1, 2, 3,"}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=60, max_retries=0
    )


def tokens(server: RunningServer, text: str) -> list[int]:
    r = requests.post(
        server.url + "/tokenize",
        json={"text": text, "add_special_tokens": False},
        headers=server.headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def post(server: RunningServer, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(server.url + path, json=body, headers=server.headers, timeout=60)


def test_continue_final_message_goes_on_from_the_assistants_text(
    client: openai.OpenAI, server: RunningServer
) -> None:
    """The prompt is the turns before the prefill, the assistant's opening and the prefill's
    own text, with no closing marker: the answer equals a completion of that text."""
    opened = "<|im_start|>user\nCount from 1 to 10.<|im_end|>\n<|im_start|>assistant\n"
    extra = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    r = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=[USER, PREFILL], max_tokens=6, temperature=0.0,
        extra_body=extra,
    )  # fmt: skip
    assert r.usage.prompt_tokens == len(tokens(server, opened)) + len(tokens(server, "1, 2, 3,"))
    plain = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=[USER, PREFILL], max_tokens=6, **GREEDY
    )
    assert plain.usage.prompt_tokens != r.usage.prompt_tokens  # a closed turn and a new one
    ids = tokens(server, opened) + tokens(server, "1, 2, 3,")
    same = client.completions.create(
        model=TINY_MODEL_NAME, prompt=ids, max_tokens=6, **GREEDY
    ).choices[0]
    assert r.choices[0].message.content == same.text
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model=TINY_MODEL_NAME, messages=[USER], max_tokens=2,
            extra_body={"continue_final_message": True},
        )  # fmt: skip
    # the prefill alone: nothing before it to render (was "messages must be a non-empty list")
    with pytest.raises(openai.BadRequestError, match="a message before the assistant"):
        client.chat.completions.create(
            model=TINY_MODEL_NAME, messages=[PREFILL], max_tokens=2,
            extra_body={"continue_final_message": True},
        )  # fmt: skip


@pytest.mark.parametrize("where", ["field", "chat_template_kwargs"])
def test_add_generation_prompt_false_leaves_the_turn_unopened(
    client: openai.OpenAI, server: RunningServer, where: str
) -> None:
    closed = "<|im_start|>user\nCount from 1 to 10.<|im_end|>\n"
    extra: dict[str, Any] = (
        {"add_generation_prompt": False}
        if where == "field"
        else {"chat_template_kwargs": {"add_generation_prompt": False}}
    )
    r = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=[USER], max_tokens=1, temperature=0.0, extra_body=extra
    )
    assert r.usage.prompt_tokens == len(tokens(server, closed))


def test_a_negative_seed_is_a_seed(client: openai.OpenAI) -> None:
    """OpenAI documents seed as int64; vLLM and SGLang take -1."""
    args = {"model": TINY_MODEL_NAME, "prompt": "The quick", "max_tokens": 8, "temperature": 1.0}
    first = client.completions.create(seed=-1, **args).choices[0].text
    assert client.completions.create(seed=-1, **args).choices[0].text == first
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(seed=-(2**63) - 1, **args)


def test_json_null_takes_the_fields_default(server: RunningServer) -> None:
    chat = {
        "model": TINY_MODEL_NAME, "messages": [USER], "max_tokens": 2, "n": None,
        "stream": None, "logprobs": None, "parallel_tool_calls": None, "temperature": None,
    }  # fmt: skip
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    comp = {"model": TINY_MODEL_NAME, "prompt": "hi", "echo": None, "n": None, "stream": None}
    r = post(server, "/v1/completions", {**comp, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 16  # null max_tokens: up to the context
    r = post(server, "/v1/chat/completions", {"model": TINY_MODEL_NAME, "messages": None})
    assert r.status_code == 400  # a required field stays required


def test_matched_stop_names_the_stop_that_ended_the_choice(
    client: openai.OpenAI, server: RunningServer
) -> None:
    forced = tokens(server, " hello")[0]  # every step samples it: it ends the text at once
    text = post(server, "/detokenize", {"tokens": [forced]}).json()["text"]
    args = {
        "model": TINY_MODEL_NAME, "prompt": "The quick", "max_tokens": 8, "temperature": 0.0,
        "logit_bias": {str(forced): 100}, "stop": [text],
    }  # fmt: skip
    choice = client.completions.create(**args).choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["matched_stop"] == text
    last = list(client.completions.create(stream=True, **args))[-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["matched_stop"] == text
    del args["stop"]
    by_length = client.completions.create(**args).choices[0]
    assert by_length.finish_reason == "length" and by_length.model_extra["matched_stop"] is None
    chat = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=[USER], max_tokens=8, temperature=0.0,
        logit_bias={str(forced): 100}, stop=[text],
    )  # fmt: skip
    assert chat.choices[0].model_extra["matched_stop"] == text


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    server: RunningServer,
) -> None:
    body = {
        "model": TINY_MODEL_NAME, "messages": [USER], "max_tokens": 5, "stream": True,
        "temperature": 0.0, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    with requests.post(
        server.url + "/v1/chat/completions", json=body, headers=server.headers, stream=True,
        timeout=60,
    ) as r:  # fmt: skip
        events = [
            json.loads(line[len("data: ") :])
            for line in r.iter_lines(decode_unicode=True)
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert content and all(e["usage"] is not None for e in content)
    counts = [e["usage"]["completion_tokens"] for e in content]
    assert counts == sorted(counts) and counts[-1] <= 5
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
