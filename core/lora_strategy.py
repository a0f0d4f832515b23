"""Multi-LoRA as a step strategy (core/interfaces.py): a request names its adapter
(``Req.lora_name``), which ``admit`` resolves (an unknown name is refused) and whose radix-cache
namespace it takes (``extra_key``: no prefix is shared across adapters); ``admissible`` lets
it start only once its adapter holds a slot (core/lora.py, ``LoRASlots``); ``before_forward``
tells the wrapped projections each token's slot. Adapters load and unload at run time
(``load``, ``unload``: the engine loop calls them between steps)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixserve.core.config_checks import ConfigError
from radixserve.core.interfaces import StepStrategy
from radixserve.core.lora import (
    AdapterWeights,
    LoRAAdapter,
    LoRARegistry,
    LoRASlots,
    parse_lora_paths,
)
from radixserve.core.request import InvalidRequest

logger = logging.getLogger(__name__)


def check_combination(config: Any, tp_size: int) -> None:
    """Refuse, naming the flag, what LoRA serving does not run with."""
    if not config.enable_lora:
        return
    refused = (
        ("--speculative-algorithm", config.speculative_algorithm is not None),
        ("--disaggregation-mode", config.disaggregation_mode != "null"),
        ("--tp-size > 1", tp_size > 1),
        ("--pp-size > 1", config.pp_size > 1),
        ("--enable-torch-compile", config.enable_torch_compile),
        ("--quantization", config.quantization is not None),
    )
    for flag, on in refused:
        if on:
            raise ConfigError(f"--enable-lora does not run with {flag} yet; drop one of them")


def slot_bytes(config: Any, model: Any, itemsize: int) -> int:
    """Device memory of the adapter slots (A and B of every targeted projection, at
    --max-lora-rank), set aside before the KV pool is sized; 0 with LoRA off."""
    if not config.enable_lora:
        return 0
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_heads * d, model.num_kv_heads * d
    inter = int(model.raw.get("intermediate_size") or 0)
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
             "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    per_rank = sum(sum(sizes[m]) for m in config.lora_target_modules)
    slots = config.max_loras_per_batch
    return slots * config.max_lora_rank * per_rank * model.num_layers * itemsize


class LoRAStrategy(StepStrategy):
    def __init__(self, config: Any, weights: AdapterWeights, table_rows: int) -> None:
        self.registry = LoRARegistry(config.max_lora_rank, tuple(config.lora_target_modules))
        self.slots = LoRASlots(config.max_loras_per_batch, weights)
        self.weights = weights
        self.running: dict[str, Any] = {}  # rid -> request holding a slot
        self.slot_of_rid: dict[str, int] = {}
        self.row_slots = torch.zeros(table_rows, dtype=torch.int64)

    # -- adapters ----------------------------------------------------------------------------

    def load(self, name: str, path: str) -> LoRAAdapter:
        adapter = self.registry.load(name, path)
        logger.info("loaded LoRA adapter '%s' (rank %d) from %s", name, adapter.rank, path)
        return adapter

    def unload(self, name: str) -> None:
        adapter = self.registry.get(name)
        self.registry.unload(name)
        if adapter is not None:
            self.slots.forget(adapter)

    def names(self) -> dict[str, str]:
        return {n: a.path for n, a in self.registry.adapters.items()}

    def check(self, name: str | None) -> None:
        """InvalidRequest naming ``name`` when no adapter of that name is loaded."""
        if name is not None and self.registry.get(name) is None:
            loaded = ", ".join(sorted(self.registry.adapters)) or "none"
            raise InvalidRequest(f"unknown LoRA adapter '{name}' (loaded: {loaded})")

    # -- the request lifecycle ---------------------------------------------------------------

    def admit(self, req: Any, compiling: bool) -> bool:
        name = req.lora_name
        if name is not None:
            self.check(name)
            req.lora = self.registry.get(name)
            req.extra_key = req.lora.cache_key
        return False

    def admissible(self, req: Any) -> bool:
        adapter = req.lora
        if adapter is None or req.rid in self.slot_of_rid:
            return True
        slot = self.slots.acquire(req.rid, adapter)
        if slot is None:
            return False
        self.slot_of_rid[req.rid] = slot
        self.running[req.rid] = req
        return True

    def released(self, req: Any) -> None:
        self._drop(req)

    def ended(self, reqs: list[Any]) -> None:
        for req in reqs:
            if req.finish_reason is not None:
                self._drop(req)

    def _drop(self, req: Any) -> None:
        if self.slot_of_rid.pop(req.rid, None) is not None:
            self.running.pop(req.rid, None)
            self.slots.release(req.rid, req.lora)

    # -- the model runner --------------------------------------------------------------------

    def before_forward(self, batch: Any) -> None:
        rows = self.row_slots
        rows.zero_()
        for rid, req in self.running.items():
            if req.req_pool_idx is not None:
                rows[req.req_pool_idx] = self.slot_of_rid[rid]
        per_req = rows[batch.req_pool_indices]
        lens = torch.tensor(batch.extend_lens, dtype=torch.int64)
        self.weights.set_step(per_req.repeat_interleave(lens))


def build(core: Any) -> LoRAStrategy | None:
    """The LoRA strategy of ``core`` (an EngineCore) with --lora-paths loaded, or None."""
    runner = core.runner
    config = runner.config
    if not config.enable_lora:
        return None
    strategy = LoRAStrategy(config, runner.lora_weights, runner.req_to_token.table.shape[0])
    for name, path in parse_lora_paths(config.lora_paths).items():
        strategy.load(name, path)
    return strategy


def lora_of(core: Any) -> LoRAStrategy | None:
    """``core``'s LoRA strategy, None when LoRA is off."""
    return next((s for s in core.strategies if isinstance(s, LoRAStrategy)), None)


def check_request_adapter(core: Any, name: str | None) -> None:
    """InvalidRequest naming ``name`` when ``core`` cannot serve that adapter."""
    if name is None:
        return
    lora = lora_of(core)
    if lora is None:
        raise InvalidRequest(
            f"the request names the LoRA adapter '{name}', but LoRA is off; start the engine "
            "with --enable-lora (and --lora-paths) or drop lora_path"
        )
    lora.check(name)
