"""Multi-LoRA on SmolLM2 (float32, CPU) against transformers + peft: two random adapters
(rank 8 and rank 64, all seven projections) and the base model in one batch, through the
offline Engine and the server; the same prompt under each adapter gets that adapter's own
output, and its cached prefix is never another adapter's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from lora_adapters import make_adapter, peft_greedy
from platform_choice import CPU_FLAGS
from server_process import RunningServer, start_server, stop_server

pytestmark = pytest.mark.slow

N = 10
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
ADAPTERS = ["r8", "r64", None]


@pytest.fixture(scope="module")
def adapters(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("smollm2-lora")
    return {
        "r8": make_adapter(smollm2_dir, tmp / "r8", rank=8, seed=1, scale=1.0),
        "r64": make_adapter(smollm2_dir, tmp / "r64", rank=64, seed=2, rslora=True, scale=1.0),
    }


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tok(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(
    smollm2_dir: Path, adapters: dict[str, Path], prompt_ids: list[list[int]]
) -> dict[tuple[int, str | None], list[int]]:
    """Each prompt under each adapter and the base model."""
    runs = [(i, a) for i in range(len(PROMPTS)) for a in ADAPTERS]
    outs = peft_greedy(smollm2_dir, adapters, [(prompt_ids[i], a) for i, a in runs], N)
    return dict(zip(runs, outs, strict=True))


def test_the_adapters_change_the_outputs(reference: dict) -> None:
    for i in range(len(PROMPTS)):  # else equal outputs below would prove nothing
        assert len({tuple(reference[i, a]) for a in ADAPTERS}) == 3


def test_offline_engine_mixed_batch_equals_peft(
    smollm2_dir: Path, adapters: dict[str, Path], prompt_ids: list[list[int]], reference: dict
) -> None:
    from radixserve.entrypoints.engine import Engine

    paths = [f"{name}={path}" for name, path in adapters.items()]
    params = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}
    with Engine(str(smollm2_dir), lora_paths=paths, dtype="float32", plugins={"hardware": "cpu"},
                max_loras_per_batch=2, max_total_tokens=8192) as engine:  # fmt: skip
        # every prompt under every adapter, in one call: one batch of all three kinds
        runs = [(i, a) for a in ADAPTERS for i in range(len(PROMPTS))]
        out = engine.generate(
            input_ids=[prompt_ids[i] for i, _ in runs], sampling_params=params,
            lora_path=[a for _, a in runs],
        )  # fmt: skip
        for (i, a), o in zip(runs, out, strict=True):
            assert o["output_ids"] == reference[i, a], (PROMPTS[i], a)
        # again, one at a time: the whole prompt is cached, under its own adapter only
        again = engine.generate(input_ids=prompt_ids[0], sampling_params=params, lora_path="r8")
        assert again["output_ids"] == reference[0, "r8"]
        assert again["meta_info"]["cached_tokens"] == len(prompt_ids[0]) - 1


@pytest.fixture(scope="module")
def server(
    smollm2_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("lora-smollm2-server") / "server.log"
    args = [*CPU_FLAGS, "--model-path", str(smollm2_dir), "--dtype", "float32",
            "--lora-paths", *(f"{n}={p}" for n, p in adapters.items()),
            "--max-loras-per-batch", "2", "--debug-leak-check"]  # fmt: skip
    running = start_server(args, log, timeout=600)
    yield running
    code = stop_server(running)
    assert code == 0, f"server exited with {code}:\n{running.log()[-4000:]}"


def test_server_mixed_batch_equals_peft(
    server: RunningServer, prompt_ids: list[list[int]], reference: dict
) -> None:
    runs = [(i, a) for a in ADAPTERS for i in range(len(PROMPTS))]
    body = {
        "input_ids": [prompt_ids[i] for i, _ in runs],
        "lora_path": [a for _, a in runs],
        "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True},
    }
    r = requests.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    for (i, a), o in zip(runs, r.json(), strict=True):
        assert o["output_ids"] == reference[i, a], (PROMPTS[i], a)


def test_server_cache_is_per_adapter(
    server: RunningServer, prompt_ids: list[list[int]], reference: dict
) -> None:
    """A prompt not sent before: its second run under r8 hits the cache, its first under r64
    and under the base model does not, and each gets its own adapter's output."""
    ids = prompt_ids[1][::-1]  # a prompt no test sent before
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

    def run(adapter: str | None) -> dict:
        body = {"input_ids": ids, "sampling_params": params, "lora_path": adapter}
        r = requests.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    first, second = run("r8"), run("r8")
    other, base = run("r64"), run(None)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == len(ids) - 1
    assert other["meta_info"]["cached_tokens"] == 0 and base["meta_info"]["cached_tokens"] == 0
    assert second["output_ids"] == first["output_ids"]
    assert len({tuple(x["output_ids"]) for x in (first, other, base)}) == 3
