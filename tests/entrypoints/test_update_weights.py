"""/update_weights_from_disk against a real server started on tiny Llama A: bad checkpoints are
refused with A still serving; a good one (B: same config, other seed) is loaded in place after
the requests in flight finish on A, and later requests get B's greedy output. The server runs
with --debug-leak-check, so a KV leak would make it exit non-zero."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file
from server_process import TINY_API_KEY, RunningServer, start_server, stop_server, tiny_server_args
from tiny_models import make_tiny_llama_dir

PROMPT = [5, 6, 7, 8, 9]
SHORT = 16  # tokens compared with transformers
LONG = 400  # tokens of the requests in flight during an update


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("weights")
    a = make_tiny_llama_dir(tmp / "a", seed=0, max_position_embeddings=1024)
    b = make_tiny_llama_dir(tmp / "b", seed=1, max_position_embeddings=1024)
    wider = make_tiny_llama_dir(tmp / "wider", seed=2, hidden_size=96, max_position_embeddings=1024)
    # B's shapes, but RoPE or the LM head's tying differ from A's: fixed when A's model was
    # built, so a reload cannot take them (a reload used to answer 200 and keep A's)
    rope = make_tiny_llama_dir(tmp / "rope", seed=1, rope_theta=5e5, max_position_embeddings=1024)
    tied = make_tiny_llama_dir(
        tmp / "tied", seed=1, tie_word_embeddings=True, max_position_embeddings=1024
    )
    # B's config, but the last tensor read (the final norm) has the wrong shape: loading fails
    # after every other tensor was copied in, so the old weights must be put back.
    broken = tmp / "broken"
    shutil.copytree(b, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    return {"a": a, "b": b, "wider": wider, "broken": broken, "rope": rope, "tied": tied}


@pytest.fixture(scope="module")
def server_a(
    dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("update-weights-server") / "server.log"
    running = start_server(tiny_server_args(dirs["a"]), log, TINY_API_KEY, timeout=300)
    yield running
    code = stop_server(running)
    assert code == 0, f"server exited with {code}:\n{running.log()[-4000:]}"


def hf_greedy(model_dir: Path, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def body(n: int, stream: bool = False) -> dict:
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    return {"input_ids": PROMPT, "sampling_params": params, "stream": stream}


def generate(server: RunningServer, n: int = SHORT) -> list[int]:
    r = requests.post(server.url + "/generate", json=body(n), headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def update(server: RunningServer, path: Path | str) -> requests.Response:
    return requests.post(
        server.url + "/update_weights_from_disk",
        json={"model_path": str(path)},
        headers=server.headers,
        timeout=120,
    )


def test_update_weights_in_place(server_a: RunningServer, dirs: dict[str, Path]) -> None:
    ref_a, ref_b = hf_greedy(dirs["a"], SHORT), hf_greedy(dirs["b"], SHORT)
    assert ref_a != ref_b  # the two checkpoints are told apart by their outputs
    assert generate(server_a) == ref_a
    long_a = generate(server_a, LONG)

    # refused: the old weights keep serving
    for path, needle in [
        (dirs["a"] / "missing", "not a model directory"),
        (dirs["wider"], "hidden_size"),
        (dirs["rope"], "rope_theta"),
        (dirs["tied"], "tie_word_embeddings"),
        (dirs["broken"], "model.norm.weight"),
    ]:
        r = update(server_a, path)
        assert r.status_code == 400, r.text
        assert r.json()["success"] is False and needle in r.json()["message"], r.text
        assert generate(server_a) == ref_a

    # requests in flight when the update arrives finish on A's weights: the update waits
    streams = [
        requests.post(
            server_a.url + "/generate", json=body(LONG, stream=True), headers=server_a.headers,
            stream=True, timeout=120,
        )
        for _ in range(2)
    ]  # fmt: skip
    lines = [s.iter_lines() for s in streams]
    for it in lines:
        assert next(line for line in it if line).startswith(b"data:")  # each one is running
    finals: list[dict] = []

    def read_rest(it: Iterator[bytes]) -> None:
        events = [line for line in it if line]
        assert events[-1] == b"data: [DONE]"
        finals.append(json.loads(events[-2][len(b"data:") :]))

    readers = [threading.Thread(target=read_rest, args=(it,)) for it in lines]
    for t in readers:
        t.start()
    r = update(server_a, dirs["b"])
    for t in readers:
        t.join()
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and isinstance(r.json()["num_paused_requests"], int)
    assert [f["output_ids"] for f in finals] == [long_a, long_a]

    # afterwards: B's outputs (the prefix cache held A's KV for this prompt: it was flushed)
    assert generate(server_a) == ref_b
    info = requests.get(server_a.url + "/get_server_info", headers=server_a.headers).json()
    assert info["kv"]["in_use"] == 0 and info["kv"]["locked"] == 0


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({}, "model_path"),
        ({"model_path": ""}, "model_path"),
        ({"model_path": 5}, "model_path"),
        ({"model_path": "/x", "load_format": "gguf"}, "load_format"),
    ],
)
def test_bad_update_requests_are_400(server_a: RunningServer, payload: dict, needle: str) -> None:
    r = requests.post(
        server_a.url + "/update_weights_from_disk", json=payload, headers=server_a.headers
    )
    assert r.status_code == 400, r.text
    assert needle in r.text
