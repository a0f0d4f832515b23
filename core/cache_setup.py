"""Which prefix cache the engine runs: none (``--disable-radix-cache``), the radix cache, or
the radix cache with host and storage tiers (``--enable-hierarchical-cache``,
core/hicache.py)."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.hicache import HiRadixCache
from radixserve.core.hicache_pool import HostKVPool
from radixserve.core.hicache_storage import GuardedStorage
from radixserve.core.interfaces_capabilities import CopiesHostKVLayers
from radixserve.core.plugins import PluginHost
from radixserve.core.radix_cache import NoPrefixCache, RadixCache

logger = logging.getLogger(__name__)


def build_cache(
    runner: Any, config: EngineConfig, host: PluginHost, model_dir: str
) -> RadixCache | NoPrefixCache:
    """The engine's prefix cache over ``runner``'s allocator, slot table and KV pool."""
    if config.disable_radix_cache:
        return NoPrefixCache(runner.allocator, runner.req_to_token)
    if not config.enable_hierarchical_cache:
        return RadixCache(runner.allocator, runner.req_to_token)
    pool = runner.kv_pool
    per_token = HostKVPool.bytes_per_token(pool)
    if config.hicache_size is not None:
        size = int(config.hicache_size * 1e9) // per_token
    else:
        size = int(runner.allocator.size * config.hicache_ratio)
    if size <= runner.allocator.size:
        raise ConfigError(
            f"the host KV pool ({size} tokens) must be larger than the device pool "
            f"({runner.allocator.size} tokens): raise --hicache-ratio above 1 or --hicache-size"
        )
    layout, io_backend = host_pool_defaults(config, pool.k[0].device)
    platform = runner.platform
    layer_copy = platform.host_kv_layer_copy() if isinstance(platform, CopiesHostKVLayers) else None
    host_pool = HostKVPool(pool, size, config.page_size, layout, io_backend, layer_copy)
    storage = _storage(runner, config, host)
    mc = runner.model_config
    namespace = "|".join(
        str(x) for x in (model_dir, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                         host_pool.dtype, config.page_size)
    )  # fmt: skip
    logger.info(
        "hierarchical cache: host pool of %d tokens (%.2f GB, %s, %s loads), write policy %s, "
        "storage %s", host_pool.size, host_pool.size * per_token / 1e9, layout,
        "per-layer" if host_pool.layer_copy is not None else "whole",
        config.hicache_write_policy, runner.plugins.names["hicache_storage"],
    )  # fmt: skip
    return HiRadixCache(
        runner.allocator, runner.req_to_token, host_pool, config.hicache_write_policy,
        storage, namespace,
    )  # fmt: skip


def host_pool_defaults(config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """--hicache-mem-layout and --hicache-io-backend, each the flag's value or the device's
    default. On CUDA: page_first (one copy moves a page of every layer: 30-34 GB/s with
    scattered host pages on an H200, where layer_first's per-layer copies made 3.5 GB/s,
    docs/benchmarks.md) on a copy stream; elsewhere layer_first (the CPU's gathers are faster
    into per-layer buffers) copied directly."""
    on_cuda = device.type == "cuda"
    layout = config.hicache_mem_layout or ("page_first" if on_cuda else "layer_first")
    return layout, config.hicache_io_backend or ("kernel" if on_cuda else "direct")


def _storage(runner: Any, config: EngineConfig, host: PluginHost) -> GuardedStorage | None:
    name = runner.plugins.names["hicache_storage"]
    extra = json.loads(config.hicache_storage_backend_extra_config or "{}")
    backend = host.registries["hicache_storage"].get(name).factory(extra)
    return None if backend is None else GuardedStorage(backend, name)
