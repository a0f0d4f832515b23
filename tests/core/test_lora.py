"""core/lora.py: --lora-paths parsing, reading PEFT directories (scaling, refusals) and the
slot pool (shared slots, pins, least-recently-used loads, waiting when every slot is held)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_adapters import RecordedWeights, named_adapter
from safetensors.torch import save_file

from radixserve.core.config import EngineConfig
from radixserve.core.config_checks import ConfigError
from radixserve.core.lora import (
    LORA_MODULES,
    LoRASlots,
    load_adapter,
    parse_lora_paths,
)


def write_peft(path: Path, rank: int, alpha: float, modules: tuple[str, ...] = ("q_proj",),
               **extra: object) -> Path:  # fmt: skip
    path.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, **extra}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = {}
    for m in modules:
        block = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
        key = f"base_model.model.model.layers.0.{block}.{m}"
        tensors[f"{key}.lora_A.weight"] = torch.ones(rank, 8)
        tensors[f"{key}.lora_B.weight"] = torch.ones(8, rank)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_lora_paths_name_and_bare_path() -> None:
    assert parse_lora_paths(("a=/x/y", "/m/adapter-b/")) == {
        "a": "/x/y",
        "adapter-b": "/m/adapter-b/",
    }
    with pytest.raises(ConfigError, match="'a' twice"):
        parse_lora_paths(("a=/x", "a=/y"))


def test_config_defaults_and_refusals() -> None:
    cfg = EngineConfig(lora_paths=("a=/x",))
    assert cfg.enable_lora and cfg.lora_target_modules == LORA_MODULES
    with pytest.raises(ConfigError, match="'qkv' is unknown"):
        EngineConfig(enable_lora=True, lora_target_modules=("qkv",))
    with pytest.raises(ConfigError, match="--lora-backend 'cuda'"):
        EngineConfig(enable_lora=True, lora_backend="cuda")


def test_peft_scaling_and_names(tmp_path: Path) -> None:
    a = load_adapter("a", str(write_peft(tmp_path / "a", 4, 16.0)), 64, LORA_MODULES)
    assert a.scaling == 4.0 and a.rank == 4
    assert set(a.weights) == {"layers.0.self_attn.q_proj.weight"}
    rs = load_adapter("rs", str(write_peft(tmp_path / "rs", 16, 8.0, use_rslora=True)), 64,
                      LORA_MODULES)  # fmt: skip
    assert rs.scaling == 2.0  # alpha / sqrt(r)
    assert a.cache_key != load_adapter("a", str(tmp_path / "a"), 64, LORA_MODULES).cache_key


def test_what_cannot_be_applied_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rank 32, over --max-lora-rank 16"):
        load_adapter("big", str(write_peft(tmp_path / "big", 32, 32)), 16, LORA_MODULES)
    down = str(write_peft(tmp_path / "down", 4, 4, ("down_proj",)))
    with pytest.raises(ConfigError, match="adapts 'down_proj', outside --lora-target-modules"):
        load_adapter("down", down, 64, ("q_proj", "v_proj"))
    with pytest.raises(ConfigError, match="use_dora"):
        load_adapter("dora", str(write_peft(tmp_path / "dora", 4, 4, use_dora=True)), 64,
                     LORA_MODULES)  # fmt: skip
    with pytest.raises(ConfigError, match="not a PEFT adapter directory"):
        load_adapter("none", str(tmp_path), 64, LORA_MODULES)


def test_slots_share_pin_evict_least_recently_used_and_wait() -> None:
    weights = RecordedWeights()
    slots = LoRASlots(2, weights)
    a, b, c = named_adapter("a", 1), named_adapter("b", 2), named_adapter("c", 3)
    assert slots.acquire("r1", a) == 1 and slots.acquire("r2", a) == 1  # shared, loaded once
    assert slots.acquire("r3", b) == 2
    assert slots.acquire("r4", c) is None  # every slot held by running requests: c waits
    slots.release("r3", b)
    assert slots.acquire("r4", c) == 2  # b's slot, unheld now, takes c
    slots.release("r1", a), slots.release("r2", a), slots.release("r4", c)
    assert slots.acquire("r5", b) == 1  # a's slot was used least recently
    assert weights.loads == [(1, "a"), (2, "b"), (2, "c"), (1, "b")]
    assert slots.acquire("r6", c) == 2  # c still in its slot: no load
    assert len(weights.loads) == 4


def test_what_lora_does_not_run_with_is_refused() -> None:
    from radixserve.core.lora_strategy import check_combination

    check_combination(EngineConfig(enable_lora=True), 1)
    with pytest.raises(ConfigError, match="--enable-lora does not run with --tp-size > 1"):
        check_combination(EngineConfig(enable_lora=True), 2)
    with pytest.raises(ConfigError, match="with --speculative-algorithm"):
        check_combination(EngineConfig(enable_lora=True, speculative_algorithm="NGRAM"), 1)
    with pytest.raises(ConfigError, match="with --quantization"):
        check_combination(EngineConfig(enable_lora=True, quantization="int8wo"), 1)
