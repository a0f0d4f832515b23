"""core/lora.py in detail, without a model: every refusal of a PEFT directory with its message,
the defaults read from adapter_config.json, tensor names, --lora-paths items, the registry,
and the slot pool's bookkeeping (loads, forget)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import RecordedWeights, named_adapter
from safetensors.torch import save_file

from radixserve.core.config_checks import ConfigError
from radixserve.core.lora import (
    LORA_MODULES,
    LoRARegistry,
    LoRASlots,
    load_adapter,
    parse_lora_paths,
)

Q = "base_model.model.model.layers.0.self_attn.q_proj"


def write(path: Path, cfg: Any, tensors: dict[str, torch.Tensor] | None = None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    text = cfg if isinstance(cfg, str) else json.dumps(cfg)
    (path / "adapter_config.json").write_text(text)
    if tensors is None:
        tensors = {f"{Q}.lora_A.weight": torch.ones(4, 8), f"{Q}.lora_B.weight": torch.ones(8, 4)}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def refused(path: str, max_rank: int = 64, targets: tuple[str, ...] = LORA_MODULES) -> str:
    with pytest.raises(ConfigError) as err:
        load_adapter("ad", path, max_rank, targets)
    return str(err.value)


def test_a_directory_needs_both_files(tmp_path: Path) -> None:
    only_cfg = tmp_path / "cfg"
    only_cfg.mkdir()
    (only_cfg / "adapter_config.json").write_text("{}")
    only_weights = tmp_path / "w"
    write(only_weights, {})
    (only_weights / "adapter_config.json").unlink()
    for path in (only_cfg, only_weights):
        assert refused(str(path)) == (
            f"LoRA adapter 'ad': '{path}' is not a PEFT adapter directory (it needs "
            "adapter_config.json and adapter_model.safetensors)"
        )


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ("[1]", "{cfg} does not describe a LoRA adapter"),
        ({"peft_type": "PROMPT_TUNING"}, "{cfg} does not describe a LoRA adapter"),
        ({"peft_type": "lora"}, "{cfg} does not describe a LoRA adapter"),
        ({"use_dora": True}, "use_dora is not supported"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern is not supported"),
        ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern is not supported"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
    ],
)
def test_configs_this_server_cannot_apply(tmp_path: Path, cfg: Any, message: str) -> None:
    path = write(tmp_path / "a", cfg)
    cfg_path = Path(path) / "adapter_config.json"
    assert refused(path) == "LoRA adapter 'ad': " + message.format(cfg=cfg_path)


def test_a_config_that_is_not_json(tmp_path: Path) -> None:
    path = write(tmp_path / "a", "{nope")
    text = refused(path)
    prefix = f"LoRA adapter 'ad': {Path(path) / 'adapter_config.json'} is not valid JSON: "
    assert text.startswith(prefix) and "line 1 column 2" in text


def test_features_turned_off_are_accepted(tmp_path: Path) -> None:
    path = write(
        tmp_path / "a",
        {"peft_type": "LORA", "r": 4, "use_dora": False, "rank_pattern": {}, "bias": "none"},
    )
    assert load_adapter("ad", path, 64, LORA_MODULES).rank == 4


def test_ranks(tmp_path: Path) -> None:
    assert refused(write(tmp_path / "zero", {"r": 0})) == (
        "LoRA adapter 'ad' has rank 0, over --max-lora-rank 64; raise --max-lora-rank"
    )
    assert refused(write(tmp_path / "big", {"r": 5}), max_rank=4) == (
        "LoRA adapter 'ad' has rank 5, over --max-lora-rank 4; raise --max-lora-rank"
    )
    one = load_adapter("ad", write(tmp_path / "one", {"r": 1, "lora_alpha": 3}), 1, LORA_MODULES)
    assert (one.rank, one.scaling) == (1, 3.0)
    # PEFT's defaults: r 8, lora_alpha = r (scaling 1), no peft_type means LoRA
    default = load_adapter("ad", write(tmp_path / "default", {}), 8, LORA_MODULES)
    assert (default.rank, default.scaling) == (8, 1.0)
    assert refused(write(tmp_path / "d7", {}), max_rank=7).startswith(
        "LoRA adapter 'ad' has rank 8"
    )
    rs = load_adapter("ad", write(tmp_path / "rs", {"r": 9, "use_rslora": True}), 9, LORA_MODULES)
    assert rs.scaling == pytest.approx(9 / math.sqrt(9))


def test_an_unreadable_weights_file(tmp_path: Path) -> None:
    path = write(tmp_path / "a", {})
    weights = Path(path) / "adapter_model.safetensors"
    weights.write_bytes(b"not safetensors")
    assert refused(path).startswith(f"LoRA adapter 'ad': cannot read {weights}: ")


def test_what_an_adapter_holds(tmp_path: Path) -> None:
    k = "base_model.model.model.layers.2.self_attn.k_proj"
    down = "model.layers.1.mlp.down_proj"  # without PEFT's wrapper prefix
    tensors = {
        f"{k}.lora_A.weight": torch.full((2, 8), 0.5, dtype=torch.float16),
        f"{k}.lora_B.weight": torch.full((6, 2), 2.0, dtype=torch.bfloat16),
        f"{down}.lora_A.weight": torch.zeros(2, 4),
        f"{down}.lora_B.weight": torch.ones(4, 2),
    }
    path = write(tmp_path / "a", {"r": 2, "lora_alpha": 8}, tensors)
    a = load_adapter("ad", Path(path), 2, LORA_MODULES)  # type: ignore[arg-type]
    assert (a.name, a.path, a.rank, a.scaling) == ("ad", path, 2, 4.0)
    assert isinstance(a.path, str)
    assert set(a.weights) == {"layers.2.self_attn.k_proj.weight", "layers.1.mlp.down_proj.weight"}
    A, B = a.weights["layers.2.self_attn.k_proj.weight"]
    assert (A.dtype, B.dtype, A.shape, B.shape) == (torch.float32, torch.float32, (2, 8), (6, 2))
    assert torch.equal(A, torch.full((2, 8), 0.5)) and torch.equal(B, torch.full((6, 2), 2.0))
    A, B = a.weights["layers.1.mlp.down_proj.weight"]
    assert torch.equal(A, torch.zeros(2, 4)) and torch.equal(B, torch.ones(4, 2))
    b = load_adapter("ad", path, 2, LORA_MODULES)
    assert b.uid > a.uid
    assert a.cache_key == f"lora:ad#{a.uid}"


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (f"{Q}.weight", f"unexpected tensor '{Q}.weight'"),
        (f"{Q}.lora_C.weight", f"unexpected tensor '{Q}.lora_C.weight'"),
        (f"{Q}.lora_A.bias", f"unexpected tensor '{Q}.lora_A.bias'"),
        # the last ".lora_" splits the name
        (f"{Q}.lora_x.lora_A.bias", f"unexpected tensor '{Q}.lora_x.lora_A.bias'"),
    ],
)
def test_unexpected_tensors(tmp_path: Path, key: str, message: str) -> None:
    tensors = {f"{Q}.lora_A.weight": torch.ones(4, 8), key: torch.ones(1)}
    assert refused(write(tmp_path / "a", {"r": 4}, tensors)) == f"LoRA adapter 'ad': {message}"


def test_a_name_with_lora_inside_is_split_at_its_last_lora(tmp_path: Path) -> None:
    base = "base_model.model.model.lora_layers.0.self_attn.q_proj"
    tensors = {f"{base}.lora_A.weight": torch.ones(4, 8), f"{base}.lora_B.weight": torch.ones(8, 4)}
    a = load_adapter("ad", write(tmp_path / "a", {"r": 4}, tensors), 4, LORA_MODULES)
    assert set(a.weights) == {"lora_layers.0.self_attn.q_proj.weight"}


def test_halves_and_targets(tmp_path: Path) -> None:
    half = {f"{Q}.lora_A.weight": torch.ones(4, 8)}
    assert refused(write(tmp_path / "a", {"r": 4}, half)) == (
        "LoRA adapter 'ad': 'layers.0.self_attn.q_proj.weight' lacks lora_A or lora_B"
    )
    assert refused(write(tmp_path / "b", {"r": 4}), targets=("k_proj", "v_proj")) == (
        "LoRA adapter 'ad' adapts 'q_proj', outside --lora-target-modules (k_proj, v_proj)"
    )
    # the projection is the name's second-to-last component, however deep the module
    deep = "base_model.model.model.layers.0.block.inner.q_proj"
    tensors = {f"{deep}.lora_A.weight": torch.ones(4, 8), f"{deep}.lora_B.weight": torch.ones(8, 4)}
    a = load_adapter("ad", write(tmp_path / "c", {"r": 4}, tensors), 4, ("q_proj",))
    assert set(a.weights) == {"layers.0.block.inner.q_proj.weight"}
    short = {"q_proj.lora_A.weight": torch.ones(4, 8), "q_proj.lora_B.weight": torch.ones(8, 4)}
    a = load_adapter("ad", write(tmp_path / "d", {"r": 4}, short), 4, ("q_proj",))
    assert set(a.weights) == {"q_proj.weight"}


def test_lora_paths_items() -> None:
    assert parse_lora_paths(()) == {}
    assert parse_lora_paths((" a = /x/y ", "/m/b//", "rel/c", "d=/p=q")) == {
        "a": "/x/y",
        "b": "/m/b//",
        "c": "rel/c",
        "d": "/p=q",
    }
    # a bare path is named by its last component, whatever it ends with
    assert parse_lora_paths(("/m/LORAX/", "adapterX")) == {
        "LORAX": "/m/LORAX/",
        "adapterX": "adapterX",
    }
    for item in ("=/x", "a=", " = ", "/"):
        with pytest.raises(ConfigError) as err:
            parse_lora_paths((item,))
        assert str(err.value) == f"--lora-paths '{item}': give NAME=PATH or a directory path"
    with pytest.raises(ConfigError) as err:
        parse_lora_paths(("a=/x", "/y/a"))
    assert str(err.value) == "--lora-paths names the adapter 'a' twice"


def test_the_registry(tmp_path: Path) -> None:
    registry = LoRARegistry(4, ("q_proj",))
    assert (registry.max_rank, registry.targets, registry.adapters) == (4, ("q_proj",), {})
    path = write(tmp_path / "a", {"r": 4})
    a = registry.load("a", path)
    assert (a.name, registry.get("a"), registry.get("b")) == ("a", a, None)
    with pytest.raises(ConfigError) as err:
        registry.load("a", path)
    assert str(err.value) == "a LoRA adapter named 'a' is already loaded; unload it first"
    assert registry.get("a") is a
    # the registry's rank bound and targets apply
    assert "over --max-lora-rank 4" in str(
        pytest.raises(ConfigError, registry.load, "big", write(tmp_path / "big", {"r": 5})).value
    )
    k = "base_model.model.model.layers.0.self_attn.k_proj"
    tensors = {f"{k}.lora_A.weight": torch.ones(4, 8), f"{k}.lora_B.weight": torch.ones(8, 4)}
    with pytest.raises(ConfigError, match="outside --lora-target-modules"):
        registry.load("k", write(tmp_path / "k", {"r": 4}, tensors))
    assert list(registry.adapters) == ["a"]
    registry.unload("a")
    assert registry.get("a") is None and registry.adapters == {}
    with pytest.raises(ConfigError) as err:
        registry.unload("a")
    assert str(err.value) == "no LoRA adapter named 'a' is loaded"
    assert registry.load("a", path).uid != a.uid  # loaded again: another adapter


def test_the_slot_pool_counts_loads_and_forgets() -> None:
    weights = RecordedWeights()
    slots = LoRASlots(2, weights)
    assert (slots.size, slots.weights, slots.loads) == (2, weights, 0)
    assert set(slots.holders) == {1, 2}  # slot 0 is the base model's, never handed out
    a, b, c = named_adapter("a", 1), named_adapter("b", 2), named_adapter("c", 3)
    assert slots.acquire("r1", a) == 1 and slots.loads == 1
    assert slots.acquire("r2", a) == 1 and slots.loads == 1
    assert slots.acquire("r3", b) == 2 and slots.loads == 2
    slots.release("r3", c)  # an adapter in no slot: nothing to release
    slots.release("r3", b)
    slots.forget(a)  # held by r1 and r2: stays
    assert slots.slot_of == {1: 1, 2: 2}
    slots.release("r1", a), slots.release("r2", a)
    slots.forget(a)  # unheld now: its slot is free at once, and taken first
    assert slots.slot_of == {2: 2} and slots.adapter_of == {2: b}
    slots.forget(c)  # in no slot: nothing
    assert slots.acquire("r4", c) == 1 and slots.loads == 3
    assert slots.acquire("r5", a) == 2 and slots.loads == 4  # b's slot, least recently used
    assert slots.slot_of == {3: 1, 1: 2} and slots.adapter_of == {1: c, 2: a}
    assert weights.loads == [(1, "a"), (2, "b"), (1, "c"), (2, "a")]
