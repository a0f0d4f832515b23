"""How a model directory's files and config.json become the built model: which safetensors files
are read, which layers slide (as transformers derives it), what a weight reload may change, and
the one-line ``ConfigError`` for configs the engine does not support. Tiny random models, no
forward passes beyond building and loading."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import make_tiny_model_dir

from radixserve.core.config import EngineConfig
from radixserve.core.model_runner import ModelRunner
from radixserve.core.plugins import default_host
from radixserve.core.weights import count_parameters, iter_weights, safetensors_files


def _hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.state_dict()


def _stray_consolidated(model_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Mistral repos ship ``consolidated.safetensors`` (native names) beside the HF files."""
    native = {
        k.replace("model.layers.", "layers.").replace("self_attn.q_proj", "attention.wq"): v
        for k, v in state.items()
    }
    save_file(
        {k: v.clone().contiguous() for k, v in native.items()},
        str(model_dir / "consolidated.safetensors"),
    )


def test_only_the_checkpoints_own_safetensors_files_are_read(tmp_path: Path) -> None:
    """Sharded (index.json: only its shards) and single-file (model.safetensors) checkpoints
    with a stray consolidated.safetensors beside them: the engine reads and counts only the
    checkpoint's tensors and builds the model."""
    from transformers import AutoModelForCausalLM

    single = make_tiny_model_dir(tmp_path / "single", "mistral", "MistralForCausalLM")
    model = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    state = model.state_dict()
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(single / name, sharded / name)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    expected = sum(t.numel() for t in state.values())
    for model_dir in (single, sharded):
        _stray_consolidated(model_dir, state)
        assert "consolidated.safetensors" not in {p.name for p in safetensors_files(model_dir)}
        assert count_parameters(model_dir) == expected
        assert {name for name, _ in iter_weights(model_dir, torch.float32)} == set(state)
        config = EngineConfig(max_total_tokens=256, dtype="float32")
        ModelRunner(model_dir, config, default_host())  # loads every weight, none unexpected


# ---- sliding windows, as transformers derives them ----------------------------------------------


def _windows(model_dir: Path) -> list[int]:
    config = EngineConfig(
        max_total_tokens=256, dtype="float32", plugins=("attention=torch_native",)
    )
    runner = ModelRunner(model_dir, config, default_host())
    return [layer.attn_options.get("sliding_window", 0) for layer in runner.model.layers]


def _hf_windows(model_dir: Path) -> list[int]:
    """Each layer's window in transformers' model (Mistral's is the config's, on every layer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    default = getattr(model.config, "sliding_window", None)
    return [
        getattr(layer.self_attn, "sliding_window", default) or 0 for layer in model.model.layers
    ]


SLIDING = {
    # Mistral: every layer slides when the config sets a window
    "mistral": ("mistral", "MistralForCausalLM", {"sliding_window": 8}, [8, 8, 8], None),
    # Qwen3-MoE: use_sliding_window slides every layer (it has no layer_types)
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
        [8, 8, 8],
        None,
    ),  # fmt: skip
    # Qwen2 without layer_types: the layers from max_window_layers on slide
    "qwen2-no-layer-types": (
        "qwen2",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        [0, 8, 8],
        "layer_types",
    ),
    # ... and none without use_sliding_window
    "qwen2-off-no-layer-types": (
        "qwen2",
        "Qwen2ForCausalLM",
        {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 1},
        [0, 0, 0],
        "layer_types",
    ),
}


@pytest.mark.parametrize("case", list(SLIDING))
def test_sliding_window_layers_match_transformers(tmp_path: Path, case: str) -> None:
    model_type, arch, overrides, expected, drop = SLIDING[case]
    model_dir = make_tiny_model_dir(
        tmp_path / case, model_type, arch, num_hidden_layers=3, **overrides
    )
    config = json.loads((model_dir / "config.json").read_text())
    if drop is not None:  # an older config.json, written before transformers kept the field
        config.pop(drop, None)
        if not config.get("use_sliding_window"):
            config["sliding_window"] = 8  # Qwen2.5 configs keep the window while it is off
        (model_dir / "config.json").write_text(json.dumps(config))
    assert _hf_windows(model_dir) == expected
    assert _windows(model_dir) == expected


# ---- what a weight reload may change ------------------------------------------------------------

GEMMA2 = {
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "attn_logit_softcapping": 4.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}


def _edited(src: Path, out: Path, **changes: object) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    for field in [k for k, v in changes.items() if v is None]:
        del config[field]  # None: the field is missing
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_reload_refuses_any_config_field_that_shaped_the_model(tmp_path: Path) -> None:
    """Gemma 2's soft-capping, score scale, layer types, activation, ...: a reload keeps what
    the model was built with, so a checkpoint that changes them is refused (with the old weights
    serving); fields that shape nothing (dtype, versions, "_" keys) may differ."""
    from radixserve.core.config import ConfigError

    a = make_tiny_model_dir(tmp_path / "a", "gemma2", "Gemma2ForCausalLM", **GEMMA2)
    b = make_tiny_model_dir(tmp_path / "b", "gemma2", "Gemma2ForCausalLM", seed=1, **GEMMA2)
    config = EngineConfig(
        max_total_tokens=256, dtype="float32", plugins=("attention=torch_native",)
    )
    runner = ModelRunner(a, config, default_host())
    before = {n: p.clone() for n, p in runner.model.named_parameters()}
    refused = {
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": None,
        "query_pre_attn_scalar": 16,
        "layer_types": ["full_attention"] * 2,
        "hidden_activation": "gelu",
        "max_position_embeddings": 64,
    }
    for field, value in refused.items():
        bad = _edited(b, tmp_path / f"bad-{field}", **{field: value})
        with pytest.raises(ConfigError, match=f"has {field}="):
            runner.reload_weights(bad)
    for name, p in runner.model.named_parameters():
        assert torch.equal(p, before[name]), name
    free = _edited(b, tmp_path / "free", dtype="bfloat16", transformers_version="0", _note="x")
    runner.reload_weights(free)
    state = _hf_state(b)
    torch.testing.assert_close(
        runner.model.embed_tokens.weight.cpu(), state["model.embed_tokens.weight"], atol=0, rtol=0
    )


# ---- unsupported configs: a ConfigError naming the field, at build time -------------------------


def _llama(tmp_path: Path) -> Path:
    return make_tiny_model_dir(tmp_path / "llama", "llama", "LlamaForCausalLM")


UNSUPPORTED = {
    "yarn": (
        "rope_scaling type 'yarn'",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 128,
            }
        },
    ),  # fmt: skip
    "dynamic": (
        "rope_scaling type 'dynamic'",
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
    ),
    "mlp_bias": ("mlp_bias", {"mlp_bias": True}),
    "relu2": ("hidden_act 'relu2'", {"hidden_act": "relu2"}),
    "no-intermediate-size": ("'intermediate_size'", {"intermediate_size": None}),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_config_is_a_config_error_naming_the_field(tmp_path: Path, case: str) -> None:
    from radixserve.core.config import ConfigError

    needle, changes = UNSUPPORTED[case]
    model_dir = _edited(_llama(tmp_path), tmp_path / case, **changes)
    config = EngineConfig(max_total_tokens=256, dtype="float32")
    with pytest.raises(ConfigError, match=re.escape(needle)):
        ModelRunner(model_dir, config, default_host())


def test_qwen3_moe_without_moe_intermediate_size_is_a_config_error(tmp_path: Path) -> None:
    from radixserve.core.config import ConfigError

    src = make_tiny_model_dir(
        tmp_path / "src", "qwen3_moe", "Qwen3MoeForCausalLM",
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    )  # fmt: skip
    model_dir = _edited(src, tmp_path / "bad", moe_intermediate_size=None)
    config = EngineConfig(max_total_tokens=256, dtype="float32")
    with pytest.raises(ConfigError, match="lacks required field 'moe_intermediate_size'"):
        ModelRunner(model_dir, config, default_host())
