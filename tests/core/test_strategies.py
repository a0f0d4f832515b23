"""core/strategies.py alone: what the built-in strategies reserve before the KV pool is sized,
which of them an engine core gets, and the model's LoRA preparation (no engine, no model)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lora_adapters import RecordedWeights

import radixserve
from radixserve.core import strategies
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.lora_strategy import LoRAStrategy, slot_bytes
from radixserve.core.plugins import PluginHost


class Algorithm:
    """A speculative algorithm that only states its memory needs (what ``reserve`` reads)."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, Any, torch.dtype]] = []

    def memory_needs(self, config: Any, host: Any, dtype: torch.dtype) -> tuple[int, int]:
        self.asked.append((config, host, dtype))
        return 1000, 7


def host_with_algorithm() -> PluginHost:
    def register_speculative_algorithms(register: Any) -> None:
        register("none", Algorithm)

    plugin = SimpleNamespace(
        register_speculative_algorithms=radixserve.hookimpl(register_speculative_algorithms)
    )
    return PluginHost(load_entry_points=False, extra_plugins=[("spec", plugin)])


MODEL = SimpleNamespace(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=1, num_layers=3,
                        raw={"intermediate_size": 16})  # fmt: skip
NAMES = {"speculative": "none"}


def test_the_reservation_adds_the_lora_slots_to_the_algorithms_weights() -> None:
    host = host_with_algorithm()
    lora = EngineConfig(enable_lora=True, max_loras_per_batch=2, max_lora_rank=4)
    got = strategies.reserve(host, NAMES, lora, torch.float16, 1, MODEL)
    slots = slot_bytes(lora, MODEL, 2)
    assert slots > 0
    assert isinstance(got.algorithm, Algorithm)
    assert got.algorithm.asked == [(lora, host, torch.float16)]
    assert (got.weight_bytes, got.kv_bytes_per_slot) == (1000 + slots, 7)
    assert (got.table_rows, got.node_rows) == (0, 0)  # chains: no tree rows
    # without the model (LoRA's slots unsized), the algorithm's alone
    alone = strategies.reserve(host, NAMES, lora, torch.float16, 1)
    assert (alone.weight_bytes, alone.kv_bytes_per_slot) == (1000, 7)


def test_the_reservation_holds_a_draft_trees_rows() -> None:
    tree = EngineConfig(speculative_algorithm="ngram", speculative_eagle_topk=2,
                        speculative_num_steps=3, speculative_num_draft_tokens=7)  # fmt: skip
    got = strategies.reserve(host_with_algorithm(), NAMES, tree, torch.float32, 1, MODEL)
    total, nodes = strategies.spec_tree.scratch_rows(tree)
    assert nodes > 0 and total > nodes
    assert (got.table_rows, got.node_rows) == (total, nodes)
    assert got.weight_bytes == 1000  # LoRA off: no slots


def test_the_reservation_refuses_what_the_strategies_cannot_run_with() -> None:
    host = host_with_algorithm()
    with pytest.raises(ConfigError, match="--enable-lora does not run with --tp-size > 1"):
        strategies.reserve(host, NAMES, EngineConfig(enable_lora=True), torch.float16, 2)
    pd = EngineConfig(disaggregation_mode="prefill")
    with pytest.raises(ConfigError) as err:
        strategies.reserve(host, NAMES, pd, torch.float16, 2)
    assert str(err.value) == (
        "disaggregation_mode=prefill does not run with tp_size=2 yet (each rank's KV pool "
        "holds only its heads); drop one of them"
    )
    assert strategies.reserve(host, NAMES, pd, torch.float16, 1).weight_bytes == 1000
    assert strategies.reserve(host, NAMES, EngineConfig(), torch.float16, 2).kv_bytes_per_slot == 7


def core_of(config: EngineConfig) -> Any:
    runner = SimpleNamespace(config=config, plugins=SimpleNamespace(names=NAMES),
                             model=object(), lora_weights=RecordedWeights(),
                             req_to_token=SimpleNamespace(table=torch.zeros(5, 3)))  # fmt: skip
    return SimpleNamespace(runner=runner, config=config, cache=object())


def test_a_core_gets_only_its_enabled_strategies(tmp_path: Any) -> None:
    host = host_with_algorithm()
    assert strategies.build_all(core_of(EngineConfig()), host, tmp_path) == []
    core = core_of(EngineConfig(enable_lora=True, max_lora_rank=4))
    [lora] = strategies.build_all(core, host, tmp_path)
    assert isinstance(lora, LoRAStrategy) and lora.weights is core.runner.lora_weights


class LoRAModel:
    def __init__(self) -> None:
        self.attached: list[tuple[EngineConfig, str]] = []

    def attach_lora(self, config: EngineConfig, device: str) -> str:
        self.attached.append((config, device))
        return "wrapped"


def test_the_model_is_prepared_for_lora_only_when_it_is_on() -> None:
    model = LoRAModel()
    assert strategies.prepare_model(model, EngineConfig(), "cpu") is None
    assert model.attached == []
    on = EngineConfig(enable_lora=True)
    assert strategies.prepare_model(model, on, "meta") == "wrapped"
    assert model.attached == [(on, "meta")]
    with pytest.raises(ConfigError) as err:
        strategies.prepare_model(object(), on, "cpu")
    assert str(err.value) == "--enable-lora: the model object does not support LoRA adapters"
