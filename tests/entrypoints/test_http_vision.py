"""Images through a real server on tiny random Qwen2-VL and Qwen2.5-VL models: the openai
client's image_url message (data: URL and file path) and the native image_data field give
transformers' greedy tokens; a repeated image reports cached tokens over its span and is not
encoded again (/get_server_info's multimodal counters); bad images and a text-only model answer
400 (those, and SGLang's frontend, on Qwen2-VL only: the tokenizer side is the same)."""

from __future__ import annotations

import base64
import importlib.util
from collections.abc import Iterator
from pathlib import Path
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
from tiny_vlm import load_reference, make_tiny_qwen2_vl_dir, png, reference_logprobs

from radixserve.core.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

NEW = 6
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


#: the M-RoPE families; the tests of the tokenizer side (shared by both) run on the first only
FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
TOKENIZER_SIDE = pytest.mark.parametrize("vl_dir", FAMILIES[:1], indirect=True)


@pytest.fixture(scope="module", params=FAMILIES)
def vl_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return make_tiny_qwen2_vl_dir(tmp_path_factory.mktemp(f"{family}_http"), family=family)


@pytest.fixture(scope="module")
def vl_server(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("vl-server-log") / "server.log"
    args = [*tiny_server_args(vl_dir), "--dtype", "float32", "--chunked-prefill-size", "16",
            "--max-images-per-request", "3"]  # fmt: skip
    running = start_server(args, log, TINY_API_KEY, timeout=300)
    yield running
    assert stop_server(running) == 0, running.log()[-4000:]


@pytest.fixture(scope="module")
def client(vl_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=vl_server.url + "/v1", api_key=TINY_API_KEY, timeout=60, max_retries=0
    )


def native(server: RunningServer, **body: Any) -> requests.Response:
    return requests.post(server.url + "/generate", json=body, headers=server.headers, timeout=60)


def server_info(server: RunningServer) -> dict[str, Any]:
    r = requests.get(server.url + "/get_server_info", headers=server.headers, timeout=30)
    return r.json()  # type: ignore[no-any-return]


def image_message(url: str, text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": text},
    ]}]  # fmt: skip


def test_native_image_data_matches_transformers(vl_server: RunningServer, vl_dir: Path) -> None:
    images = [png(30, 40, 21), png(44, 20, 22)]
    prompt = f"Hello {IMAGE} and {IMAGE} world"
    r = native(vl_server, text=prompt, image_data=[data_url(b) for b in images],
               sampling_params={"temperature": 0, "max_new_tokens": NEW})  # fmt: skip
    assert r.status_code == 200, r.text
    output = r.json()["output_ids"]
    ids = Tokenizer(str(vl_dir)).encode(prompt)
    ref = reference_logprobs(load_reference(vl_dir), ids, images, output)
    assert ref.argmax(-1).tolist() == output


def test_openai_image_url_and_repeat_is_cached(
    client: openai.OpenAI, vl_server: RunningServer, vl_dir: Path, tmp_path: Path
) -> None:
    image = png(32, 32, 23)
    messages = image_message(data_url(image), " what is it?")

    def ask(msgs: list[dict[str, Any]]) -> Any:
        return client.chat.completions.create(
            model=TINY_MODEL_NAME,
            messages=msgs,
            max_tokens=NEW,
            temperature=0,  # type: ignore[arg-type]
        )

    first = ask(messages)
    # the same prompt through the native route: the chat template's text with the placeholder
    rendered = Tokenizer(str(vl_dir)).apply_chat_template(
        [{"role": "user", "content": f"Look: {IMAGE} what is it?"}], add_generation_prompt=True
    )
    r = native(vl_server, text=rendered, image_data=data_url(image),
               sampling_params={"temperature": 0, "max_new_tokens": NEW})  # fmt: skip
    assert r.status_code == 200, r.text
    assert first.choices[0].message.content == r.json()["text"]
    encoded = server_info(vl_server)["multimodal"]["images_encoded"]
    # a file path to the same image: the same content hash, so a radix hit over the span
    path = tmp_path / "same.png"
    path.write_bytes(image)
    again = ask(image_message(str(path), " what is it?"))
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached == again.usage.prompt_tokens - 1  # the image span (16 tokens) included
    assert server_info(vl_server)["multimodal"]["images_encoded"] == encoded


@TOKENIZER_SIDE
def test_bad_images_are_400s(client: openai.OpenAI, vl_server: RunningServer) -> None:
    cases = {
        "not a decodable image": data_url(b"\x89PNG\r\n\x1a\n broken"),
        "allow-remote-media": "http://127.0.0.1:9/cat.png",
        "no such file": "/nonexistent/cat.png",
    }
    for message, url in cases.items():
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(
                model=TINY_MODEL_NAME,
                messages=image_message(url, "?"),
                max_tokens=2,  # type: ignore[arg-type]
            )
    r = native(
        vl_server, text=f"{IMAGE}" * 4, image_data=[data_url(png(8, 8, i)) for i in range(4)]
    )
    assert r.status_code == 400 and "max-images-per-request" in r.text
    # the server goes on serving
    ok = native(vl_server, text=f"Hi {IMAGE}", image_data=data_url(png(8, 8, 1)),
                sampling_params={"max_new_tokens": 2})  # fmt: skip
    assert ok.status_code == 200, ok.text


def test_text_only_model_refuses_image_parts(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=TINY_API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="LlamaForCausalLM takes text only"):
        client.chat.completions.create(
            model=TINY_MODEL_NAME, messages=image_message(data_url(png(8, 8, 1)), "?"),  # type: ignore[arg-type]
            max_tokens=2,
        )  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
@TOKENIZER_SIDE
def test_sglang_frontend_image_program(vl_server: RunningServer, tmp_path: Path) -> None:
    import sglang as sgl

    path = tmp_path / "noise.png"
    path.write_bytes(png(36, 28, 41))

    @sgl.function
    def describe(s, image_path):  # type: ignore[no-untyped-def]
        s += sgl.user(sgl.image(image_path) + "What is it?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=5, temperature=0))

    # the test server is served as "tiny-llama": name the template its model path would pick
    backend = sgl.RuntimeEndpoint(
        vl_server.url, api_key=TINY_API_KEY, chat_template_name="qwen2-vl"
    )
    state = describe.run(image_path=str(path), backend=backend)
    answer, text = state["answer"], state.text()
    assert text.count("<|image_pad|>") == 1
    prompt = text[: text.rindex(answer)]
    r = native(vl_server, text=prompt, image_data=data_url(path.read_bytes()),
               sampling_params={"temperature": 0, "max_new_tokens": 5})  # fmt: skip
    assert r.status_code == 200, r.text
    assert answer == r.json()["text"]
