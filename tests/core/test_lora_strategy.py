"""core/lora_strategy.py engine-free: the refused combinations, the slots' memory, and the
strategy's request lifecycle (adapter names resolved at admission, slots held while running,
each token's slot per step) on a real registry, real PEFT directories and recorded slot loads."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lora_adapters import RecordedWeights
from safetensors.torch import save_file

from radixserve.core.config import EngineConfig
from radixserve.core.config_checks import ConfigError
from radixserve.core.lora_strategy import (
    LoRAStrategy,
    build,
    check_combination,
    check_request_adapter,
    lora_of,
    slot_bytes,
)
from radixserve.core.request import FinishReason, InvalidRequest, Req, SamplingParams


def peft_dir(path: Path, rank: int = 2) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {
        f"{key}.lora_A.weight": torch.ones(rank, 8),
        f"{key}.lora_B.weight": torch.ones(8, rank),
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


class StepWeights(RecordedWeights):
    """Recorded slot loads and the last step's slot per token."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[int]] = []

    def set_step(self, token_slots: torch.Tensor) -> None:
        assert token_slots.dtype == torch.int64
        self.steps.append(token_slots.tolist())


def config(**kw: Any) -> EngineConfig:
    return EngineConfig(enable_lora=True, max_loras_per_batch=2, max_lora_rank=4, **kw)


def strategy(tmp_path: Path, names: tuple[str, ...] = ("a", "b", "c")) -> LoRAStrategy:
    lora = LoRAStrategy(config(lora_target_modules=("q_proj",)), StepWeights(), 6)
    for name in names:
        lora.load(name, peft_dir(tmp_path / name))
    return lora


def req(rid: str, lora_name: str | None) -> Req:
    r = Req(rid, [1, 2, 3], SamplingParams())
    r.lora_name = lora_name
    return r


@pytest.mark.parametrize(
    ("kw", "tp", "flag"),
    [
        ({"speculative_algorithm": "NGRAM"}, 1, "--speculative-algorithm"),
        ({"disaggregation_mode": "prefill"}, 1, "--disaggregation-mode"),
        ({}, 2, "--tp-size > 1"),
        ({"pp_size": 2}, 1, "--pp-size > 1"),
        ({"enable_torch_compile": True}, 1, "--enable-torch-compile"),
        ({"quantization": "int8wo"}, 1, "--quantization"),
    ],
)
def test_each_combination_is_refused_by_its_flag(kw: dict[str, Any], tp: int, flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_combination(EngineConfig(enable_lora=True, **kw), tp)
    assert str(err.value) == f"--enable-lora does not run with {flag} yet; drop one of them"
    check_combination(EngineConfig(**kw), tp)  # LoRA off: anything goes


def test_the_slots_memory_counts_every_targeted_projection() -> None:
    model = SimpleNamespace(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=1,
                            num_layers=3, raw={"intermediate_size": 16})  # fmt: skip
    # q 8, kv 2, inter 16: per rank q (8+8) k (8+2) v (8+2) o (8+8) gate, up (8+16) down (16+8)
    every = config(lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"))  # fmt: skip
    per_rank = 16 + 10 + 10 + 16 + 24 + 24 + 24
    assert slot_bytes(every, model, 2) == 2 * 4 * per_rank * 3 * 2
    assert slot_bytes(config(lora_target_modules=("k_proj",)), model, 4) == 2 * 4 * 10 * 3 * 4
    assert slot_bytes(config(lora_target_modules=("o_proj",)), model, 1) == 2 * 4 * 16 * 3
    model.raw = {"intermediate_size": None}  # no MLP size: its projections take nothing
    assert slot_bytes(config(lora_target_modules=("up_proj",)), model, 1) == 2 * 4 * 8 * 3
    model.raw = {}
    assert slot_bytes(config(lora_target_modules=("down_proj",)), model, 1) == 2 * 4 * 8 * 3
    assert slot_bytes(EngineConfig(max_loras_per_batch=2), model, 2) == 0  # LoRA off


def test_loading_naming_and_checking_adapters(tmp_path: Path, caplog: Any) -> None:
    lora = LoRAStrategy(config(lora_target_modules=("q_proj",)), StepWeights(), 4)
    assert (lora.running, lora.slot_of_rid, lora.names()) == ({}, {}, {})
    assert lora.row_slots.tolist() == [0, 0, 0, 0] and lora.row_slots.dtype == torch.int64
    assert (lora.registry.max_rank, lora.registry.targets, lora.slots.size) == (4, ("q_proj",), 2)
    with pytest.raises(InvalidRequest) as err:
        lora.check("x")
    assert str(err.value) == "unknown LoRA adapter 'x' (loaded: none)"
    with caplog.at_level(logging.INFO, logger="radixserve.core.lora_strategy"):
        b = lora.load("b", peft_dir(tmp_path / "b", rank=3))
    assert (b.name, b.rank) == ("b", 3)
    assert f"loaded LoRA adapter 'b' (rank 3) from {tmp_path / 'b'}" in caplog.messages
    lora.load("a", peft_dir(tmp_path / "a"))
    assert lora.names() == {"b": str(tmp_path / "b"), "a": str(tmp_path / "a")}
    lora.check("a"), lora.check(None)
    with pytest.raises(InvalidRequest) as err:
        lora.check("x")
    assert str(err.value) == "unknown LoRA adapter 'x' (loaded: a, b)"
    lora.unload("b")
    assert lora.names() == {"a": str(tmp_path / "a")}
    with pytest.raises(ConfigError, match="no LoRA adapter named 'b' is loaded"):
        lora.unload("b")


def test_admission_takes_the_adapter_and_its_cache_namespace(tmp_path: Path) -> None:
    lora = strategy(tmp_path)
    r, base = req("r", "a"), req("base", None)
    assert lora.admit(r, False) is False and lora.admit(base, True) is False
    assert r.lora is lora.registry.get("a") and r.extra_key == r.lora.cache_key
    assert (base.lora, base.extra_key) == (None, None)
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'z'"):
        lora.admit(req("z", "z"), False)


def test_slots_are_held_while_running_and_freed_once(tmp_path: Path) -> None:
    lora = strategy(tmp_path)
    weights = lora.weights
    r1, r2, r3, r4 = req("r1", "a"), req("r2", "b"), req("r3", "c"), req("r4", "a")
    for r in (r1, r2, r3, r4):
        lora.admit(r, False)
    base = req("base", None)
    assert lora.admissible(base) and lora.slot_of_rid == {}  # the base model needs no slot
    assert lora.admissible(r1) and lora.admissible(r2)
    assert lora.slot_of_rid == {"r1": 1, "r2": 2} and lora.running == {"r1": r1, "r2": r2}
    assert lora.admissible(r1) and lora.slots.holders[1] == {"r1"}  # held already: as is
    assert not lora.admissible(r3)  # both slots held: c waits
    assert "r3" not in lora.slot_of_rid and "r3" not in lora.running
    assert lora.admissible(r4) and lora.slot_of_rid["r4"] == 1  # a's slot, shared
    lora.ended([r1, r2])  # neither finished: both keep their slots
    assert set(lora.slot_of_rid) == {"r1", "r2", "r4"}
    r2.finish_reason = FinishReason("length")
    lora.ended([r1, r2])
    assert set(lora.slot_of_rid) == {"r1", "r4"} and set(lora.running) == {"r1", "r4"}
    assert lora.slots.holders[2] == set()
    lora.released(r2)  # dropped once: nothing more to release
    assert lora.admissible(r3) and lora.slot_of_rid["r3"] == 2
    assert weights.loads == [(1, "a"), (2, "b"), (2, "c")]
    lora.released(r1)
    assert lora.slots.holders[1] == {"r4"} and "r1" not in lora.running
    lora.released(r4)
    lora.unload("a")  # unheld now: its slot is forgotten
    assert lora.slots.slot_of == {lora.registry.get("c").uid: 2}


def test_before_forward_gives_each_token_its_requests_slot(tmp_path: Path) -> None:
    lora = strategy(tmp_path)
    weights = lora.weights
    r1, r2, r3 = req("r1", "a"), req("r2", "b"), req("r3", None)
    for r in (r1, r2, r3):
        lora.admit(r, False)
        assert lora.admissible(r)
    r1.req_pool_idx, r2.req_pool_idx, r3.req_pool_idx = 3, 0, 5
    lora.row_slots[4] = 7  # left over from another step: cleared
    batch = SimpleNamespace(req_pool_indices=torch.tensor([3, 5, 0, 4]), extend_lens=[2, 1, 3, 1])
    lora.before_forward(batch)
    assert weights.steps[-1] == [1, 1, 0, 2, 2, 2, 0]
    assert lora.row_slots.tolist() == [2, 0, 0, 1, 0, 0]
    r1.req_pool_idx = None  # a running request without a row yet
    lora.before_forward(SimpleNamespace(req_pool_indices=torch.tensor([0, 3]), extend_lens=[1, 1]))
    assert weights.steps[-1] == [2, 0]


def core_of(cfg: EngineConfig, strategies: list[Any] | None = None) -> Any:
    runner = SimpleNamespace(config=cfg, lora_weights=StepWeights(),
                             req_to_token=SimpleNamespace(table=torch.zeros(5, 3)))  # fmt: skip
    return SimpleNamespace(runner=runner, strategies=strategies or [])


def test_build_loads_the_lora_paths_and_requests_are_checked(tmp_path: Path) -> None:
    assert build(core_of(EngineConfig())) is None
    a, b = peft_dir(tmp_path / "a"), peft_dir(tmp_path / "adapter-b")
    cfg = EngineConfig(lora_paths=(f"x={a}", b), max_lora_rank=4,
                       lora_target_modules=("q_proj",))  # fmt: skip
    core = core_of(cfg)
    lora = build(core)
    assert lora is not None and lora.weights is core.runner.lora_weights
    assert lora.names() == {"x": a, "adapter-b": b}
    assert lora.row_slots.shape == (5,) and lora.slots.size == cfg.max_loras_per_batch
    off = core_of(EngineConfig(), [object()])
    assert lora_of(off) is None
    check_request_adapter(off, None)
    with pytest.raises(InvalidRequest) as err:
        check_request_adapter(off, "x")
    assert str(err.value) == (
        "the request names the LoRA adapter 'x', but LoRA is off; start the engine with "
        "--enable-lora (and --lora-paths) or drop lora_path"
    )
    on = core_of(cfg, [object(), lora])
    assert lora_of(on) is lora
    check_request_adapter(on, "x"), check_request_adapter(on, None)
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'y' \\(loaded: adapter-b, x\\)"):
        check_request_adapter(on, "y")
