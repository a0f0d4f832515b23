"""/v1/embeddings (through the official openai client) and SGLang's /encode against real servers:
the shared one (last-token pooling, the default) and one with ``--embedding-pooling mean`` and
small prefill chunks, both equal to a reference pooled from transformers' final hidden states."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
import torch
from server_process import (
    TINY_API_KEY,
    TINY_MODEL_NAME,
    RunningServer,
    start_server,
    stop_server,
    tiny_server_args,
)

TEXTS = ["Hello world!", "The quick brown fox jumps over the lazy dog. The quick brown fox", "0"]
TOL = 2e-4


@pytest.fixture(scope="module")
def hf_model(tiny_long_llama_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_long_llama_dir, torch_dtype=torch.float32)


def reference(hf_model, ids: list[int], pooling: str) -> list[float]:  # type: ignore[no-untyped-def]
    """The final (post-norm) hidden states, pooled and L2-normalised."""
    with torch.no_grad():
        h = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    vec = h[-1] if pooling == "last" else h.mean(dim=0)
    return torch.nn.functional.normalize(vec, dim=0).tolist()


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL


def tokenize(server: RunningServer, texts: list[str]) -> list[list[int]]:
    r = requests.post(server.url + "/tokenize", json={"prompt": texts}, headers=server.headers)
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def mean_server(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """Mean pooling, with 8-token prefill chunks so a prompt's mean spans several steps."""
    log = tmp_path_factory.mktemp("mean-server") / "server.log"
    args = [*tiny_server_args(tiny_long_llama_dir), "--embedding-pooling", "mean"]
    args += ["--chunked-prefill-size", "8"]
    running = start_server(args, log, TINY_API_KEY, timeout=300)
    yield running
    code = stop_server(running)
    assert code == 0, f"server exited with {code}:\n{running.log()[-4000:]}"


def client_of(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=60, max_retries=0
    )


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_openai_client_embeddings_equal_transformers(
    pooling: str, server: RunningServer, mean_server: RunningServer, hf_model
) -> None:  # type: ignore[no-untyped-def]
    running = server if pooling == "last" else mean_server
    client = client_of(running)
    ids = tokenize(running, TEXTS)
    # the openai client asks for base64 by default and decodes it itself
    out = client.embeddings.create(model=TINY_MODEL_NAME, input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2]
    for d, prompt in zip(out.data, ids, strict=True):
        assert_close(d.embedding, reference(hf_model, prompt, pooling))
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(p) for p in ids)
    # float encoding, token-id input (one list, and a list of lists) give the same vectors
    floats = client.embeddings.create(
        model=TINY_MODEL_NAME, input=ids, encoding_format="float"
    ).data
    one = client.embeddings.create(model="any-name", input=ids[1], encoding_format="float").data
    for d, prompt in zip(floats, ids, strict=True):
        assert_close(d.embedding, reference(hf_model, prompt, pooling))
    assert_close(one[0].embedding, floats[1].embedding)


def test_embeddings_run_beside_generation(server: RunningServer, hf_model) -> None:  # type: ignore[no-untyped-def]
    """Embedding requests share steps with a decoding request and leave it unchanged."""
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 48, "temperature": 0}}
    body["sampling_params"]["ignore_eos"] = True
    alone = requests.post(server.url + "/generate", json=body, headers=server.headers).json()
    with requests.post(
        server.url + "/generate", json={**body, "stream": True}, headers=server.headers, stream=True
    ) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line)  # the generation is running now
        assert first.startswith(b"data:")
        ids = tokenize(server, TEXTS)
        r = requests.post(server.url + "/encode", json={"text": TEXTS}, headers=server.headers)
        rest = [line for line in lines if line]
    assert r.status_code == 200, r.text
    for item, prompt in zip(r.json(), ids, strict=True):
        assert_close(item["embedding"], reference(hf_model, prompt, "last"))
        assert item["meta_info"]["prompt_tokens"] == len(prompt)
    assert rest[-1] == b"data: [DONE]"
    import json

    final = json.loads(rest[-2][len(b"data:") :])
    assert final["output_ids"] == alone["output_ids"]


def test_encode_shapes(server: RunningServer) -> None:
    url, headers = server.url + "/encode", server.headers
    one = requests.post(url, json={"text": "Hello world!"}, headers=headers).json()
    assert isinstance(one, dict) and len(one["embedding"]) == 64
    assert abs(sum(x * x for x in one["embedding"]) - 1.0) < 1e-4  # L2-normalised
    ids = tokenize(server, ["Hello world!"])[0]
    by_ids = requests.post(url, json={"input_ids": ids, "rid": "e1"}, headers=headers).json()
    assert by_ids["meta_info"]["id"] == "e1"
    assert_close(by_ids["embedding"], one["embedding"])
    batch = requests.post(url, json={"input_ids": [ids, ids[:2]]}, headers=headers).json()
    assert isinstance(batch, list) and len(batch) == 2


@pytest.mark.parametrize(
    ("route", "body", "needle"),
    [
        ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "dimensions"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": [[]]}, "input"),
        ("/v1/embeddings", {"input": ""}, "empty"),
        ("/v1/embeddings", {"input": [10**9]}, "outside the vocabulary"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": 5}, "input"),
        ("/v1/embeddings", {"input": "a\ud800"}, "surrogate"),
        ("/encode", {"text": "hi", "input_ids": [1]}, "exactly one"),
        ("/encode", {"text": [1, 2]}, "text"),
        ("/encode", {"input_ids": "hi"}, "input_ids"),
        ("/encode", {}, "exactly one"),
        ("/encode", {"input_ids": [[1], [2]], "rid": "same"}, "rid"),
    ],
)
def test_bad_embedding_requests_are_400(
    server: RunningServer, route: str, body: dict, needle: str
) -> None:
    r = requests.post(server.url + route, json=body, headers=server.headers)
    assert r.status_code == 400, r.text
    assert needle in r.text


def test_concurrent_embeddings_leave_no_kv(any_server: RunningServer, hf_model) -> None:  # type: ignore[no-untyped-def]
    """Many embedding requests at once all answer (with and without overlap scheduling) with
    the right vectors; the server (--debug-leak-check) would exit on a leak at idle, and its
    state shows nothing held."""
    server = any_server
    ids = tokenize(server, [t * 3 for t in TEXTS])
    results: list[tuple[int, int, list[float] | None]] = []

    def one(i: int) -> None:
        r = requests.post(
            server.url + "/encode", json={"text": TEXTS[i % 3] * 3}, headers=server.headers
        )
        results.append((i, r.status_code, r.json().get("embedding")))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(status for _, status, _ in results) == [200] * 8
    for i, _, embedding in results:  # asserted here: a failure in a thread would go unseen
        assert embedding is not None
        assert_close(embedding, reference(hf_model, ids[i % 3], "last"))
    info = requests.get(server.url + "/get_server_info", headers=server.headers).json()
    assert info["kv"]["in_use"] == 0 and info["kv"]["locked"] == 0
