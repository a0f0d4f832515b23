"""The built-in step strategies (core/interfaces.py, ``StepStrategy``): what each needs
before the engine is built (device memory, slot-table rows, settings it cannot run with)
and building them once the engine core exists. The core's step files call only these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.core import (
    disaggregation,
    hicache_prefetch,
    lora_strategy,
    multimodal_strategy,
    spec_setup,
    spec_tree,
)
from radixserve.core.config import ConfigError

if TYPE_CHECKING:
    import torch

    from radixserve.core.interfaces import StepStrategy
    from radixserve.core.plugins import PluginHost


@dataclass(frozen=True, slots=True)
class Reservation:
    """What the strategies set aside before the KV pool is sized."""

    algorithm: Any  # the speculative plugin's algorithm (set up by its strategy)
    weight_bytes: int  # device memory for their own weights
    kv_bytes_per_slot: int  # device memory per KV-pool slot for their own KV
    table_rows: int  # scratch rows of the slot table they need
    node_rows: int  # of which the step's own (reserved by the runner, ``scratch_rows``)


def reserve(
    host: PluginHost,
    names: dict[str, str],
    config: Any,
    dtype: torch.dtype,
    tp_size: int,
    model: Any = None,
) -> Reservation:
    """Build what must exist before the KV pool is sized; refuse settings a strategy cannot
    run with (ConfigError). ``model``: the ModelConfig (LoRA's slots are sized by it)."""
    lora_strategy.check_combination(config, tp_size)
    algorithm, weights, kv = spec_setup.algorithm_for(host, names, config, dtype, tp_size)
    if model is not None:
        weights += lora_strategy.slot_bytes(config, model, dtype.itemsize)
    mode = config.disaggregation_mode
    if tp_size > 1 and mode != "null":
        raise ConfigError(
            f"disaggregation_mode={mode} does not run with tp_size={tp_size} "
            "yet (each rank's KV pool holds only its heads); drop one of them"
        )
    total, nodes = spec_tree.scratch_rows(config)
    return Reservation(algorithm, weights, kv, total, nodes)


def build_all(core: Any, host: PluginHost, model_dir: Path) -> list[StepStrategy]:
    """The enabled strategies of ``core`` (an EngineCore: typed Any, as importing it would
    make a cycle), in the order the loop calls them."""
    found = [
        spec_setup.build(core, host, model_dir),
        disaggregation.build(core, host),
        lora_strategy.build(core),
        multimodal_strategy.build(core),
        hicache_prefetch.build(core),
    ]
    return [s for s in found if s is not None]  # type: ignore[misc]


def prepare_model(model: Any, config: Any, device: str) -> Any:
    """Wrap what the strategies need of the model, before the platform captures any graph
    of it: LoRA's projections, through the model's ``attach_lora`` (the decoders':
    plugins/models/lora_layers.py). Returns that, or None."""
    if not config.enable_lora:
        return None
    attach = getattr(model, "attach_lora", None)
    if attach is None:
        raise ConfigError(
            f"--enable-lora: the model {type(model).__name__} does not support LoRA adapters"
        )
    return attach(config, device)
