"""--enable-deterministic-inference on the CPU in bfloat16 (docs/deterministic.md): a greedy
request gets the same token ids alone, in a batch of 64, after another request cached its
prefix, with prefill chunks of 64 tokens, with n-gram speculation and with EAGLE-3 (the head
shipped for SmolLM2); seeded sampling gives the same tokens in a restarted engine (a second
Engine in the process: a server restart costs ~40 s of CPU in two processes' imports, and its
HTTP layer does not touch sampling) and in another batch. The CPU platform is named: on a GPU
machine kernels round differently. Without the flag the same traffic differs, so the
assertions can fail.

64 prompts on a tiny random model (2 layers, hidden 256, weights small enough that the top
logits lie close: bfloat16 rounding then moves the argmax, as it does on real models at long
outputs); EAGLE-3 needs SmolLM2 itself, so that case runs SmolLM2 (8 prompts, 12 tokens).
Without the flag on this CPU, bfloat16 F.linear gave the same rows at every batch size; the
differences come from torch_native's SDPA, whose decode and prefill kernels round differently.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_llama_dir

from radixserve import Engine
from radixserve.core.config import ConfigError, EngineConfig

pytestmark = pytest.mark.slow

N = 64
#: RADIXSERVE_DETERMINISTIC_TEST_HARDWARE=cuda runs the engine cases on a GPU (triton attention;
#: the issue's H200 run): `pytest -m slow tests/entrypoints/test_deterministic.py -k "not refused"`
ON_GPU = os.environ.get("RADIXSERVE_DETERMINISTIC_TEST_HARDWARE") == "cuda"
HARDWARE = "hardware=cuda" if ON_GPU else "hardware=cpu"
ATTENTION = "attention=triton" if ON_GPU else "attention=torch_native"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def close_logits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = make_tiny_llama_dir(
        tmp_path_factory.mktemp("close-logits"), hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    weights = load_file(out / "model.safetensors")  # std 0.05: close top logits
    scaled = {k: (v * 0.25 if v.dim() > 1 else v).contiguous() for k, v in weights.items()}
    save_file(scaled, out / "model.safetensors")
    return out


def _prompts() -> list[list[int]]:
    """64 prompts of 15 to 150 tokens sharing prefixes of 10 to 40 tokens."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 360) for _ in range(40)]
    out = []
    for _ in range(N):
        own = [rng.randrange(3, 360) for _ in range(rng.randrange(5, 110))]
        out.append(shared[: rng.randrange(10, 40)] + own)
    return out


def _ids(results: Any) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def _every_case(
    model: Path, deterministic: bool, dtype: str = "bfloat16"
) -> dict[str, list[list[int]]]:
    """The 64 prompts' greedy outputs in each case, torch_native attention throughout."""
    prompts = _prompts()
    kw: dict[str, Any] = dict(
        dtype=dtype, max_total_tokens=16384, max_running_requests=N,
        plugins=(HARDWARE, ATTENTION),
        enable_deterministic_inference=deterministic,
    )  # fmt: skip
    out: dict[str, list[list[int]]] = {}
    with Engine(str(model), **kw) as engine:
        out["alone"] = [
            engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts
        ]
        engine.flush_cache()
        out["batch of 64"] = _ids(engine.generate(input_ids=prompts, sampling_params=GREEDY))
        engine.flush_cache()
        donors = [p[: len(p) * 2 // 3] + [7, 8, 9] for p in prompts]  # cache 2/3 of each
        engine.generate(input_ids=donors, sampling_params={**GREEDY, "max_new_tokens": 1})
        out["prefix cached"] = _ids(engine.generate(input_ids=prompts, sampling_params=GREEDY))
    with Engine(str(model), chunked_prefill_size=64, **kw) as engine:
        out["chunks of 64"] = _ids(engine.generate(input_ids=prompts, sampling_params=GREEDY))
    spec = dict(speculative_algorithm="NGRAM", speculative_disable_pause=True)
    with Engine(str(model), speculative_disable_batch_size=N, **spec, **kw) as engine:
        out["n-gram"] = _ids(engine.generate(input_ids=prompts, sampling_params=GREEDY))
    return out


def _differing(cases: dict[str, list[list[int]]]) -> dict[str, int]:
    alone = cases["alone"]
    return {
        name: sum(a != b for a, b in zip(alone, ids, strict=True)) for name, ids in cases.items()
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_ids_identical_in_every_case(close_logits_dir: Path, dtype: str) -> None:
    """float32 too: its linears stay on the AVX2 panels where they run (batch-invariant by
    construction), else on fixed row blocks."""
    cases = _every_case(close_logits_dir, deterministic=True, dtype=dtype)
    assert all(len(ids) == N and all(len(x) == 8 for x in ids) for ids in cases.values())
    assert _differing(cases) == dict.fromkeys(cases, 0)


def test_without_the_flag_the_same_traffic_differs(close_logits_dir: Path) -> None:
    differing = _differing(_every_case(close_logits_dir, deterministic=False))
    assert sum(differing.values()) > 0, differing


def test_seeded_sampling_identical_across_engine_runs_and_batches(close_logits_dir: Path) -> None:
    """temperature 1: an explicit seed, and no seed (the engine's --random-seed), in a batch of
    16 in one engine, and alone in a second engine."""
    prompts = _prompts()[:16]
    params = [{"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "top_p": 0.95}
              | ({"seed": 1234 + i} if i % 2 else {}) for i in range(16)]  # fmt: skip
    kw: dict[str, Any] = dict(
        dtype="bfloat16", enable_deterministic_inference=True, plugins=(HARDWARE, ATTENTION)
    )
    with Engine(str(close_logits_dir), random_seed=5, **kw) as engine:
        first = _ids(engine.generate(input_ids=prompts, sampling_params=params))
    with Engine(str(close_logits_dir), random_seed=5, **kw) as engine:
        second = [
            engine.generate(input_ids=p, sampling_params=s)["output_ids"]
            for p, s in zip(prompts, params, strict=True)
        ]
    assert first == second
    assert len({tuple(x) for x in first}) > 8  # sampled, not one greedy answer repeated


def test_eagle3_accepts_exactly_what_plain_decoding_emits(smollm2_dir: Path) -> None:
    """SmolLM2 in bfloat16 with its shipped EAGLE-3 head: the same ids as without speculation
    (in deterministic mode the verify rows run the decode rows' kernels)."""
    topics = ["the sea", "a red fox", "coffee", "JSON for a user", "a library", "winter",
              "Python code to add two numbers", "rain"]  # fmt: skip
    params = {"temperature": 0, "max_new_tokens": 12}
    kw: dict[str, Any] = dict(
        dtype="bfloat16", max_total_tokens=4096, enable_deterministic_inference=True,
        plugins=(HARDWARE, ATTENTION),
    )  # fmt: skip
    with Engine(str(smollm2_dir), **kw) as engine:
        assert (
            engine.core.numerics() == "bfloat16 weights, bfloat16 KV, eager decode, deterministic"
        )
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": f"Write about {t}."}])
                   for t in topics]  # fmt: skip
        plain = _ids(engine.generate(input_ids=prompts, sampling_params=params))
    spec = dict(speculative_algorithm="EAGLE3", speculative_disable_pause=True)
    with Engine(str(smollm2_dir), speculative_disable_batch_size=8, **spec, **kw) as engine:
        drafted = _ids(engine.generate(input_ids=prompts, sampling_params=params))
        stats = engine.core.spec_stats()
    print("EAGLE-3:", stats)
    assert drafted == plain
    assert stats and stats["accepted_tokens"] > 0  # the head's drafts were taken


@pytest.mark.parametrize(
    "flags, reason",
    [
        ({"tp_size": 2}, "all-reduce"),
        ({"quantization": "int8wo"}, "tiling by row count"),
        ({"enable_torch_compile": True}, "inductor"),
        ({"enable_lora": True}, "adapter kernels"),
    ],
)
def test_what_cannot_be_made_invariant_is_refused(flags: dict[str, Any], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        EngineConfig(enable_deterministic_inference=True, **flags)


def test_an_attention_backend_without_the_mode_is_refused(tiny_llama_dir: Path) -> None:
    from radixserve.plugins.hardware.cpu import _cpu_paged_reason

    if _cpu_paged_reason() is not None:
        pytest.skip(f"cpu_paged does not run here: {_cpu_paged_reason()}")
    with pytest.raises(ConfigError, match="cpu_paged attention backend has no batch-invariant"):
        Engine(
            str(tiny_llama_dir), plugins=("hardware=cpu", "attention=cpu_paged"),
            dtype="float32", enable_deterministic_inference=True, max_total_tokens=1024,
        )  # fmt: skip


def test_the_cpu_defaults_to_torch_native_in_this_mode(tiny_llama_dir: Path) -> None:
    from radixserve.plugins.hardware.cpu import CpuPlatform

    platform = CpuPlatform()
    platform.resolve_config(EngineConfig(enable_deterministic_inference=True), str(tiny_llama_dir))
    assert platform.default_plugins()["attention"] == "torch_native"
