"""Multi-LoRA serving: PEFT adapters, the registry of loaded names, and the slot pool.

An adapter is read once from a PEFT directory (``adapter_config.json`` +
``adapter_model.safetensors``) into host tensors (``LoRAAdapter``); ``LoRARegistry`` maps the
names requests use to adapters. The device holds ``max_loras_per_batch`` slots of adapter
weights (``AdapterWeights``, built by the model plugin: plugins/models/lora_layers.py); slot 0 is
the base model (zero weights), so every token's adapter is a slot index: data, not shape.

``LoRASlots`` gives each running request's adapter a slot: an adapter already in a slot is
shared, a free slot or the least recently used one that no running request holds is loaded,
and a request whose adapter finds no slot waits (the scheduler admits only requests whose
adapters fit, so every step's batch fits). The step strategy that ties this to the engine is
core/lora_strategy.py.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from radixserve.core.config_checks import LORA_MODULES, ConfigError

__all__ = ["LORA_MODULES", "AdapterWeights", "LoRAAdapter", "LoRARegistry", "LoRASlots"]
_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter's host weights: HF parameter name of the wrapped linear (``layers.3.
    self_attn.q_proj.weight``, no ``model.`` prefix) -> (A [r, in], B [out, r])."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    uid: int  # unique per load: a name loaded again is another adapter (another cache key)

    @property
    def cache_key(self) -> str:
        """The radix cache's namespace for this adapter's requests."""
        return f"lora:{self.name}#{self.uid}"


def load_adapter(name: str, path: str, max_rank: int, targets: tuple[str, ...]) -> LoRAAdapter:
    """Read a PEFT LoRA directory. ConfigError naming the problem for anything this server
    cannot apply (rank over ``max_rank``, a module outside ``targets``, DoRA, biases)."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg_path, weights_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights_path.is_file():
        raise ConfigError(
            f"LoRA adapter '{name}': '{path}' is not a PEFT adapter directory (it needs "
            "adapter_config.json and adapter_model.safetensors)"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"LoRA adapter '{name}': {cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"LoRA adapter '{name}': {cfg_path} does not describe a LoRA adapter")
    for key in ("use_dora", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ConfigError(f"LoRA adapter '{name}': {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"LoRA adapter '{name}': bias='{cfg['bias']}' is not supported")
    rank = int(cfg.get("r", 8))
    if not 0 < rank <= max_rank:
        raise ConfigError(
            f"LoRA adapter '{name}' has rank {rank}, over --max-lora-rank {max_rank}; "
            "raise --max-lora-rank"
        )
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ConfigError(f"LoRA adapter '{name}': cannot read {weights_path}: {e}") from None
    return LoRAAdapter(name, str(path), rank, scaling, _pairs(name, tensors, targets), next(_ids))


def _pairs(
    name: str, tensors: dict[str, torch.Tensor], targets: tuple[str, ...]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's ``base_model.model.model.layers.N.<block>.<proj>.lora_A.weight`` / ``lora_B``
    pairs, by the base model's parameter name."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        base, sep, tail = key.rpartition(".lora_")
        if not sep or tail not in ("A.weight", "B.weight"):
            raise ConfigError(f"LoRA adapter '{name}': unexpected tensor '{key}'")
        hf = base.removeprefix("base_model.model.").removeprefix("model.") + ".weight"
        proj = hf.rsplit(".", 2)[-2]
        if proj not in targets:
            raise ConfigError(
                f"LoRA adapter '{name}' adapts '{proj}', outside --lora-target-modules "
                f"({', '.join(targets)})"
            )
        halves.setdefault(hf, {})[tail[0]] = tensor.float()
    pairs = {}
    for hf, half in halves.items():
        if set(half) != {"A", "B"}:
            raise ConfigError(f"LoRA adapter '{name}': '{hf}' lacks lora_A or lora_B")
        pairs[hf] = (half["A"], half["B"])
    return pairs


def parse_lora_paths(items: tuple[str, ...]) -> dict[str, str]:
    """``NAME=PATH`` or a bare ``PATH`` (named by its last component) -> {name: path}."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item.rstrip("/")).name, item
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ConfigError(f"--lora-paths '{item}': give NAME=PATH or a directory path")
        if name in out:
            raise ConfigError(f"--lora-paths names the adapter '{name}' twice")
        out[name] = path
    return out


class LoRARegistry:
    """The adapter names requests may use; unloading a name leaves requests that already
    resolved it running with their adapter."""

    def __init__(self, max_rank: int, targets: tuple[str, ...]) -> None:
        self.max_rank, self.targets = max_rank, targets
        self.adapters: dict[str, LoRAAdapter] = {}

    def load(self, name: str, path: str) -> LoRAAdapter:
        if name in self.adapters:
            raise ConfigError(f"a LoRA adapter named '{name}' is already loaded; unload it first")
        adapter = load_adapter(name, path, self.max_rank, self.targets)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise ConfigError(f"no LoRA adapter named '{name}' is loaded")

    def get(self, name: str) -> LoRAAdapter | None:
        return self.adapters.get(name)


class AdapterWeights(Protocol):
    """The device side of the slots (plugins/models/lora_layers.py): each wrapped projection
    adds ``scaling * (x @ A^T) @ B^T`` of its token's slot."""

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (1..), zeros for the modules it does not adapt."""

    def set_step(self, token_slots: torch.Tensor) -> None:
        """The next forward's slot per token (host int64 tensor, 0: the base model)."""


class LoRASlots:
    """Slots 1..``size`` of ``weights``: which adapter each holds and which requests hold it."""

    def __init__(self, size: int, weights: AdapterWeights) -> None:
        self.size, self.weights = size, weights
        self.holders: dict[int, set[str]] = {s: set() for s in range(1, size + 1)}
        self.adapter_of: dict[int, LoRAAdapter] = {}
        self.slot_of: dict[int, int] = {}  # adapter uid -> slot
        self.lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, size + 1))
        self.loads = 0  # adapters copied into a slot so far

    def acquire(self, rid: str, adapter: LoRAAdapter) -> int | None:
        """The slot of ``adapter`` for request ``rid`` (loaded now if needed); None when
        every slot is held by running requests of other adapters."""
        slot = self.slot_of.get(adapter.uid)
        if slot is None:
            free = [s for s in self.lru if not self.holders[s]]
            if not free:
                return None
            slot = free[0]  # the least recently used of the unheld slots
            old = self.adapter_of.pop(slot, None)
            if old is not None:
                del self.slot_of[old.uid]
            self.weights.load(slot, adapter)
            self.adapter_of[slot], self.slot_of[adapter.uid] = adapter, slot
            self.loads += 1
        self.holders[slot].add(rid)
        self.lru.move_to_end(slot)
        return slot

    def release(self, rid: str, adapter: LoRAAdapter) -> None:
        slot = self.slot_of.get(adapter.uid)
        if slot is not None:
            self.holders[slot].discard(rid)

    def forget(self, adapter: LoRAAdapter) -> None:
        """An unloaded adapter's slot, if no request holds it, is free at once."""
        slot = self.slot_of.get(adapter.uid)
        if slot is not None and not self.holders[slot]:
            del self.slot_of[adapter.uid], self.adapter_of[slot]
            self.lru.move_to_end(slot, last=False)
