"""Settings a hardware platform chooses for its device: a third-party platform's defaults are
used, a flag wins over them, the core's fill what neither sets, each with where it came from;
a default the KV pool cannot hold is lowered with the reason. The CUDA platform's defaults
scale with the card (checked with a card described, not present), and its server engine
process takes one torch thread unless OMP_NUM_THREADS is set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from platform_choice import on_cpu  # tests/support

from radixserve import Engine
from radixserve.core.config import CORE_DEFAULTS, ConfigError, EngineConfig, ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.plugins import PluginHost
from radixserve.core.spec_strategy import speculator_of
from radixserve.plugins.hardware.cpu import CpuPlatform
from radixserve.plugins.hardware.cuda import CudaPlatform

GIB = 1 << 30


class TunedCpu(CpuPlatform):
    name = "tuned_cpu"
    defaults: dict[str, Any] = {}

    def engine_defaults(self, model: ModelConfig, weight_bytes: int) -> dict[str, Any]:
        assert weight_bytes > 0 and model.vocab_size > 0
        return dict(self.defaults)


class _Plugin:
    @hookimpl
    def register_hardware_platforms(self, register: Any) -> None:
        register("tuned_cpu", TunedCpu, description="a CPU platform with its own defaults")


def _engine(model_dir: Path, defaults: dict[str, Any], **flags: Any) -> Engine:
    TunedCpu.defaults = defaults
    host = PluginHost(extra_plugins=[("tuned", _Plugin())])
    return Engine(str(model_dir), plugins=["hardware=tuned_cpu"], host=host, **flags)


def test_platform_defaults_flags_and_core_defaults(tiny_llama_dir: Path) -> None:
    defaults = {"chunked_prefill_size": 96, "max_running_requests": 7, "prefill_gather_steps": 3}
    with _engine(tiny_llama_dir, defaults, max_total_tokens=2048, mem_fraction_static=0.3) as eng:
        settings = eng.core.runner.settings
        assert settings.describe() == {
            "max_running_requests": {"value": 7, "from": "tuned_cpu default"},
            "mem_fraction_static": {"value": 0.3, "from": "flag"},
            "chunked_prefill_size": {"value": 96, "from": "tuned_cpu default"},
            "cuda_graph_max_bs": {"value": CORE_DEFAULTS["cuda_graph_max_bs"], "from": "default"},
            "prefill_shrink_after_decodes": {"value": 0, "from": "offline Engine default"},
            "prefill_gather_steps": {"value": 3, "from": "tuned_cpu default"},
            "speculative_disable_batch_size": {"value": 32, "from": "default"},
        }
        assert eng.core.scheduler.config.chunked_prefill_size == 96
        assert eng.core.scheduler.config.prefill_gather_steps == 3
        assert eng.core.scheduler.config.max_running_requests == 7
        assert eng.core.runner.req_to_token.table.shape[0] == 8
        out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
        assert len(out["output_ids"]) == 2
    with _engine(tiny_llama_dir, defaults, max_total_tokens=2048, chunked_prefill_size=64) as eng:
        assert eng.core.runner.settings.origins["chunked_prefill_size"] == "flag"
        assert eng.core.scheduler.config.chunked_prefill_size == 64


def test_the_offline_engine_takes_whole_chunks_over_the_platforms_latency_default(
    tiny_llama_dir: Path,
) -> None:
    """The CPU platform shrinks a step's prefill beside many decodes (the server's inter-token
    latency); the offline Engine's own default, 0, comes before it, and a flag before both. A
    server's engine (EngineConfig without the offline usage) keeps the platform's."""
    platform = CpuPlatform().engine_defaults(None, 0)  # type: ignore[arg-type]
    assert platform["prefill_shrink_after_decodes"] > 0
    with _engine(tiny_llama_dir, dict(platform), max_total_tokens=2048) as eng:
        entry = eng.core.runner.settings.describe()["prefill_shrink_after_decodes"]
        assert entry == {"value": 0, "from": "offline Engine default"}
        assert eng.core.scheduler.config.prefill_shrink_after_decodes == 0
    flagged = {"max_total_tokens": 2048, "prefill_shrink_after_decodes": 3}
    with _engine(tiny_llama_dir, dict(platform), **flagged) as eng:
        assert eng.core.scheduler.config.prefill_shrink_after_decodes == 3
    config = EngineConfig(model_path=str(tiny_llama_dir))
    _, settings = config.with_platform_defaults("cpu", platform)
    assert settings.origins["prefill_shrink_after_decodes"] == "cpu default"


def test_speculation_stops_above_two_decodes_on_the_cpu(tiny_llama_dir: Path) -> None:
    """The CPU platform's speculation cut-off is 2 decoding requests (a verify step's extra rows
    cost most there); a flag overrides it, and the core's default is 32."""
    from radixserve.core.speculative import Speculator

    with Engine(str(tiny_llama_dir), **on_cpu({"speculative_algorithm": "NGRAM"})) as eng:
        entry = eng.core.runner.settings.describe()["speculative_disable_batch_size"]
        assert entry == {"value": 2, "from": "cpu default"}
        speculator = speculator_of(eng.core)
        assert isinstance(speculator, Speculator)
        assert speculator.draft_length(2) > 0 and speculator.draft_length(3) == 0
    flagged = {"speculative_algorithm": "NGRAM", "speculative_disable_batch_size": 16}
    with Engine(str(tiny_llama_dir), **on_cpu(flagged)) as eng:
        assert speculator_of(eng.core) is not None and speculator_of(eng.core).draft_length(16) > 0
    assert CORE_DEFAULTS["speculative_disable_batch_size"] == 32


def test_a_default_the_pool_cannot_hold_is_lowered_with_the_reason(tiny_llama_dir: Path) -> None:
    # A pool sized from memory (no --max-total-tokens): CpuPlatform caps it at 2**18 tokens.
    with _engine(tiny_llama_dir, {"max_running_requests": 1 << 20}) as eng:
        settings = eng.core.runner.settings
        assert settings.max_running_requests == eng.core.runner.kv_size // 128 < 1 << 20
        assert settings.origins["max_running_requests"].startswith(f"lowered from {1 << 20}")
        assert eng.core.scheduler.config.max_running_requests == settings.max_running_requests


def test_a_negative_gather_step_count_is_refused() -> None:
    with pytest.raises(ConfigError, match="prefill_gather_steps must be >= 0, got -1"):
        EngineConfig(prefill_gather_steps=-1)
    assert EngineConfig(prefill_gather_steps=0).prefill_gather_steps == 0


def test_a_platform_setting_that_does_not_exist_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="unknown defaults"):
        _engine(tiny_llama_dir, {"max_batch_tokens": 1}, max_total_tokens=2048)


def test_cuda_defaults_scale_with_the_card(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ModelConfig.from_dict(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
         "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
         "vocab_size": 128256}
    )  # fmt: skip
    platform = object.__new__(CudaPlatform)  # no device here
    platform.device = "cuda:0"
    picked = {}
    for gib in (24, 80, 141):
        props = type("Props", (), {"total_memory": gib * GIB})()
        monkeypatch.setattr("torch.cuda.get_device_properties", lambda _d, p=props: p)
        picked[gib] = platform.engine_defaults(model, 16 * GIB)
    assert [picked[g]["chunked_prefill_size"] for g in (24, 80, 141)] == [2048, 8192, 8192]
    assert picked[141]["cuda_graph_max_bs"] == picked[141]["max_running_requests"] == 256
    for gib, chosen in picked.items():
        left = (1 - chosen["mem_fraction_static"]) * gib
        assert left >= 0.08 * gib - 0.01  # room for activations, graphs and the sampler
    assert 0.85 <= picked[141]["mem_fraction_static"] < 0.95
    assert set(picked[141]) <= set(CORE_DEFAULTS)
    assert EngineConfig(**picked[141])  # valid settings
    # speculation's cut-off: the core's for an 8B model, 4 for a launch-bound small one
    assert "speculative_disable_batch_size" not in picked[141]
    small = platform.engine_defaults(model, 270 << 20)
    assert small["speculative_disable_batch_size"] == 4
