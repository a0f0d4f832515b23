"""Idefics3 through a real server: the openai client's image_url message on a tiny random model
gives transformers' greedy tokens (the chat template's text with ``<image>``, tiled and expanded
as transformers' processor does), and the same image again is a radix hit over all its tiles
without encoding it again."""

from __future__ import annotations

import base64
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
from tiny_vlm import idefics3_reference_logprobs, make_tiny_idefics3_dir, png

from radixserve.core.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

NEW = 6


def images_encoded(server: RunningServer) -> int:
    info = requests.get(server.url + "/get_server_info", headers=server.headers, timeout=30)
    return int(info.json()["multimodal"]["images_encoded"])


def test_openai_image_url_matches_transformers_and_repeat_is_cached(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = make_tiny_idefics3_dir(tmp_path_factory.mktemp("idefics3_http"))
    log = tmp_path_factory.mktemp("idefics3-server-log") / "server.log"
    args = [*tiny_server_args(model), "--dtype", "float32", "--chunked-prefill-size", "16"]
    server = start_server(args, log, TINY_API_KEY, timeout=300)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=60,
                               max_retries=0)  # fmt: skip
        image = png(44, 36, 31)
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "Look: "},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": " what is it?"},
        ]}]  # fmt: skip

        def ask() -> Any:
            return client.chat.completions.create(
                model=TINY_MODEL_NAME,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=NEW,
                temperature=0,
            )

        first = ask()
        prompt = Tokenizer(str(model)).apply_chat_template(
            [{"role": "user", "content": "Look: <image> what is it?"}], add_generation_prompt=True
        )
        body = {"text": prompt, "image_data": url,
                "sampling_params": {"temperature": 0, "max_new_tokens": NEW}}  # fmt: skip
        r = requests.post(server.url + "/generate", json=body, headers=server.headers, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == first.choices[0].message.content
        output = r.json()["output_ids"]
        ref = idefics3_reference_logprobs(model, prompt, [image], output)
        assert ref.argmax(-1).tolist() == output
        encoded = images_encoded(server)
        again = ask()
        assert again.choices[0].message.content == first.choices[0].message.content
        cached = again.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
        assert cached == again.usage.prompt_tokens - 1  # the five tiles' spans included
        assert images_encoded(server) == encoded
    finally:
        code = stop_server(server)
    assert code == 0, server.log()[-4000:]
