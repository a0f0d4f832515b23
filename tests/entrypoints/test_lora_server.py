"""LoRA serving through the real server, on a tiny random Llama with random PEFT adapters
(float32, CPU) compared with transformers + peft: more adapters than --max-loras-per-batch
slots still serve every request (prompts in prefill chunks); adapters load and unload at run
time while another request streams; an unknown adapter is a 400 naming it (native lora_path
and OpenAI's "base:adapter"); with LoRA off a lora_path is a 400 too."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from lora_adapters import make_adapter, peft_greedy
from server_process import RunningServer, start_server, stop_server, tiny_server_args

PROMPT = [5, 6, 7, 8, 9, 10]
N = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tiny-lora")
    # large enough to change a random model's greedy tokens
    return {
        name: make_adapter(tiny_llama_dir, tmp / name, rank=rank, seed=seed, scale=4.0)
        for name, rank, seed in (("a", 4, 1), ("b", 8, 2), ("c", 16, 3))
    }


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    names: list[str | None] = [*adapters, None]
    outs = peft_greedy(tiny_llama_dir, adapters, [(PROMPT, n) for n in names], N)
    assert len({tuple(o) for o in outs}) == len(names)  # each adapter changes the output
    return dict(zip(names, outs, strict=True))


@pytest.fixture(scope="module")
def lora_server(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("tiny-lora-server") / "server.log"
    # a and b at start, one slot: two adapters (three with c) share it in turns; prompts
    # prefill in chunks of 4 tokens, beside other requests' decodes
    args = [*tiny_server_args(tiny_llama_dir), "--lora-paths", f"a={adapters['a']}",
            str(adapters["b"]), "--max-loras-per-batch", "1", "--max-lora-rank", "16",
            "--chunked-prefill-size", "4"]  # fmt: skip
    running = start_server(args, log, timeout=300)
    yield running
    code = stop_server(running)
    assert code == 0, f"server exited with {code}:\n{running.log()[-4000:]}"


def generate(server: RunningServer, lora: str | None, n: int = N) -> requests.Response:
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": PROMPT, "lora_path": lora, "sampling_params": params}
    return requests.post(server.url + "/generate", json=body, timeout=120)


def admin(server: RunningServer, route: str, **body: str) -> requests.Response:
    return requests.post(server.url + route, json=body, timeout=60)


def test_more_adapters_than_slots_serve_every_request(
    lora_server: RunningServer, reference: dict[str | None, list[int]]
) -> None:
    names = ["a", "b", None, "a", "b", None]
    with ThreadPoolExecutor(len(names)) as pool:
        replies = list(pool.map(lambda n: generate(lora_server, n), names))
    for name, r in zip(names, replies, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference[name], name


def test_unknown_adapter_is_400_naming_it(lora_server: RunningServer) -> None:
    r = generate(lora_server, "nope")
    assert r.status_code == 400 and "unknown LoRA adapter 'nope'" in r.text, r.text
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="unknown LoRA adapter 'nope'"):
        client.completions.create(model="tiny-llama:nope", prompt="hi", max_tokens=2)


def test_openai_model_names_the_adapter(
    lora_server: RunningServer, reference: dict[str | None, list[int]]
) -> None:
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(
        model="tiny-llama:b", prompt=PROMPT, max_tokens=N, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    native = generate(lora_server, "b").json()
    assert out.choices[0].text == native["text"]
    assert out.model == "tiny-llama"


def test_load_and_unload_while_a_request_streams(
    lora_server: RunningServer, adapters: dict[str, Path], reference: dict[str | None, list[int]]
) -> None:
    params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": PROMPT, "lora_path": "a", "stream": True, "sampling_params": params}
    started, events = threading.Event(), []

    def stream() -> None:
        with requests.post(lora_server.url + "/generate", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    events.append(json.loads(line[6:]))
                    started.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert started.wait(120)
    r = admin(lora_server, "/load_lora_adapter", lora_name="c", lora_path=str(adapters["c"]))
    assert r.status_code == 200 and r.json()["success"], r.text
    assert set(r.json()["loaded_adapters"]) == {"a", "b", "c"}
    got = generate(lora_server, "c")  # waits for a's request to give the one slot back
    assert got.status_code == 200 and got.json()["output_ids"] == reference["c"]
    r = admin(lora_server, "/unload_lora_adapter", lora_name="c")
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a", "b"}
    assert generate(lora_server, "c").status_code == 400
    streaming.join(300)
    assert events[-1]["meta_info"]["completion_tokens"] == 200
    assert events[-1]["output_ids"][:N] == reference["a"]


def test_bad_loads_are_refused(lora_server: RunningServer, tmp_path: Path) -> None:
    r = admin(lora_server, "/load_lora_adapter", lora_name="x", lora_path=str(tmp_path))
    assert r.status_code == 400 and "not a PEFT adapter directory" in r.json()["error_message"]
    r = admin(lora_server, "/load_lora_adapter", lora_name="a", lora_path=str(tmp_path))
    assert r.status_code == 400 and "already loaded" in r.json()["error_message"]
    r = admin(lora_server, "/unload_lora_adapter", lora_name="zz")
    assert r.status_code == 400 and "no LoRA adapter named 'zz'" in r.json()["error_message"]


def test_lora_path_without_lora_is_400(server: RunningServer) -> None:
    body = {"input_ids": PROMPT, "lora_path": "a", "sampling_params": {"max_new_tokens": 1}}
    r = requests.post(server.url + "/generate", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400 and "serves no adapters" in r.text, r.text
