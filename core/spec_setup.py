"""Setting speculation up: the plugin's algorithm before the KV pool is sized, then the
Speculator, the step executor's kept hidden layers, and the device-side loop where it can
run (core/spec_strategy.py is the strategy itself)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from radixserve.core.config import ConfigError
from radixserve.core.interfaces import SpeculativeAlgorithm, SpeculativeContext
from radixserve.core.spec_adaptive import AdaptiveDrafting
from radixserve.core.spec_loop import LOOP_BATCH, DeviceVerify, SpecLoop
from radixserve.core.spec_strategy import Speculation
from radixserve.core.speculative import Speculator

if TYPE_CHECKING:
    from radixserve.core.plugins import PluginHost

logger = logging.getLogger(__name__)


def algorithm_for(
    host: PluginHost, names: dict[str, str], config: Any, dtype: torch.dtype, tp_size: int
) -> tuple[SpeculativeAlgorithm, int, int]:
    """The speculative plugin's algorithm, built before the KV pool is sized so its device
    memory (a draft model and its KV) is set aside: (algorithm, weight bytes, KV bytes per
    slot). EngineCore sets it up later (``build``)."""
    name = names["speculative"]
    # Under tensor parallelism the drafts come from rank 0 alone: n-gram chains need no draft
    # model (a draft model replicated or sharded on every rank is not done yet), and a tree's
    # attention mask is rank 0's attention backend's only.
    chains = name == "ngram" and config.speculative_eagle_topk == 1
    if tp_size > 1 and name != "none" and not chains:
        raise ConfigError(
            f"speculative decoding ({name}, speculative_eagle_topk="
            f"{config.speculative_eagle_topk}) does not run with tp_size={tp_size} yet (only "
            "ngram chains do); drop one of them"
        )
    algorithm = host.registries["speculative"].get(name).factory()
    weights, kv = algorithm.memory_needs(config, host, dtype)
    return algorithm, weights, kv


def build(core: Any, host: PluginHost, model_dir: Path) -> Speculation | None:
    """Speculation for ``core`` when a speculative plugin is chosen, set up, with the step
    executor told which hidden layers to keep and the device loop where it can run."""
    runner, config = core.runner, core.config
    name = runner.plugins.names["speculative"]
    if name == "none":
        return None
    algorithm = runner.reservation.algorithm
    algorithm.setup(
        SpeculativeContext(
            config=config,
            model_config=runner.model_config,
            model_path=str(model_dir),
            host=host,
            platform=runner.platform,
            dtype=runner.dtype,
            device=runner.device,
            attention=runner.plugins.names["attention"],
            kv_size=runner.kv_size,
            page_size=config.page_size,
            req_to_token=runner.req_to_token,
            eos_token_ids=core.eos_token_ids,
            target_model=runner.model,
            free_counts=runner.allocator.free_counts,
        )
    )
    speculator = Speculator(
        algorithm,
        name,
        config.draft_depth,
        runner.settings.speculative_disable_batch_size,
        runner.model_config.vocab_size,
        config.speculative_simulate_accept_len,
        config.random_seed,
        pause_unprofitable=not config.speculative_disable_pause,
        tree_nodes=config.tree_nodes,
        adaptive=(
            AdaptiveDrafting(config.draft_depth, config.tree_nodes)
            if config.speculative_adaptive
            else None
        ),
    )
    keep = runner.capabilities.keep_hidden_layers
    if algorithm.capture_hidden_layers and keep is not None:
        consumer = algorithm.target_hidden if algorithm.target_hidden_capturable else None
        keep(tuple(algorithm.capture_hidden_layers), consumer)
    strategy = Speculation(speculator, runner, core.max_context, core.overlap, host)
    strategy.uniform = runner.capabilities.uniform_rows
    strategy.loop = _device_loop(core, speculator)
    return strategy


def _device_loop(core: Any, sp: Speculator) -> SpecLoop | None:
    """The device-side speculative loop (core/spec_loop.py), where the plugin offers a
    cycle and the attention backend prepares from device tensors on an asynchronous
    device (FlashInfer plans on the host: no loop)."""
    config, runner = core.config, core.runner
    if config.disable_speculative_loop or sp.tree_nodes or sp.simulate_accept_len is not None:
        return None
    if runner.ranks.size > 1:  # it runs the model past the step executor rank 0 broadcasts
        return None
    asynchronous = runner.platform.asynchronous
    if not (asynchronous or config.enable_speculative_loop):
        return None
    attention = runner.attention
    if asynchronous and (not attention.prepares_verify_on_device or attention.plans_decode_on_host):
        return None
    algorithm = sp.algorithm
    verify = DeviceVerify(
        runner.model, attention, runner.kv_pool, runner.req_to_token,
        tuple(algorithm.capture_hidden_layers), algorithm.target_hidden,
    )  # fmt: skip
    cycle = algorithm.device_cycle(verify, min(LOOP_BATCH, sp.disable_batch_size))
    if cycle is None:
        return None
    logger.info("speculation loops on the device for up to %d requests", cycle.max_batch)
    return SpecLoop(cycle, core.scheduler, sp, core.max_context)
