"""The CPU's default for a GGUF model is the fast mode (its Q4_1 blocks, a float16 KV cache,
compiled decode steps); --dtype float32 (or any --dtype / --quantization) keeps the exact path,
and a model directory that did not come from a GGUF file is served as before."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.core.config import EngineConfig
from radixserve.plugins.hardware.cpu import CpuPlatform
from radixserve.plugins.hardware.cpu_fast import MODE_ENV, gguf_source


@pytest.fixture
def fast_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The product's default: tests/conftest.py pins the exact mode for the rest of the suite."""
    monkeypatch.delenv(MODE_ENV, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent-not-used")


def _resolve(model_dir: Path, **flags: object) -> EngineConfig:
    return CpuPlatform().resolve_config(EngineConfig(**flags), str(model_dir))  # type: ignore[arg-type]


def test_gguf_model_with_no_flags_resolves_to_the_fast_mode(
    smollm2_dir: Path, fast_default: None, caplog: pytest.LogCaptureFixture
) -> None:
    assert gguf_source(str(smollm2_dir)) is not None
    with caplog.at_level(logging.INFO, "radixserve.plugins.hardware.cpu_fast"):
        config = _resolve(smollm2_dir)
    assert config.quantization == "gguf"
    assert config.kv_cache_dtype == "float16"
    assert config.dtype == "auto"
    assert not config.enable_torch_compile  # ~2% faster for a minute's compile: not a default
    assert "CPU fast mode: gguf Q4_1 weights, float16 KV, eager decode" in caplog.text
    assert "--dtype float32" in caplog.text


@pytest.mark.parametrize(
    "flags",
    [{"dtype": "float32"}, {"dtype": "bfloat16"}, {"quantization": "int8wo"}],
    ids=["float32", "bfloat16", "int8wo"],
)
def test_a_dtype_or_quantization_keeps_the_exact_path(
    smollm2_dir: Path, fast_default: None, flags: dict[str, str]
) -> None:
    config = _resolve(smollm2_dir, **flags)
    assert config == EngineConfig(**flags)  # type: ignore[arg-type]
    assert not config.enable_torch_compile


def test_torch_compile_asked_for_is_kept_with_a_persistent_cache(
    smollm2_dir: Path, fast_default: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    config = _resolve(smollm2_dir, enable_torch_compile=True)
    assert (config.quantization, config.enable_torch_compile) == ("gguf", True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_a_chosen_kv_dtype_is_kept(smollm2_dir: Path, fast_default: None) -> None:
    config = _resolve(smollm2_dir, kv_cache_dtype="bfloat16")
    assert (config.quantization, config.kv_cache_dtype) == ("gguf", "bfloat16")


def test_an_hf_directory_and_the_exact_env_are_left_alone(
    tiny_llama_dir: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MODE_ENV, raising=False)
    assert gguf_source(str(tiny_llama_dir)) is None
    assert _resolve(tiny_llama_dir) == EngineConfig()
    monkeypatch.setenv(MODE_ENV, "exact")
    assert _resolve(smollm2_dir) == EngineConfig()


def test_engine_with_no_flags_serves_the_fast_mode(
    smollm2_dir: Path, fast_default: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(str(smollm2_dir), plugins=("hardware=cpu",), max_total_tokens=8192) as engine:
        config = engine.core.config
        assert (config.quantization, config.kv_cache_dtype) == ("gguf", "float16")
        assert not config.enable_torch_compile
        assert str(engine.core.runner.kv_dtype) == "torch.float16"
        out = engine.generate(["The capital of France is"], params)
    assert len(out[0]["output_ids"]) == 8
    assert "Paris" in out[0]["text"]
