"""core/cache_setup.py's build_cache on a real CPU KV pool, allocator and plugin host (a
namespace stands for the model runner; no model): which cache each flag gives, the host pool's
size, its storage backend and namespace."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixserve.core.cache_setup import build_cache, host_pool_defaults
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.hicache import HiRadixCache
from radixserve.core.hicache_storage import GuardedStorage
from radixserve.core.memory import KVPool, ReqToTokenPool, TokenAllocator
from radixserve.core.model_config import ModelConfig
from radixserve.core.plugins import default_host
from radixserve.core.radix_cache import NoPrefixCache, RadixCache
from radixserve.plugins.hardware.cpu import CpuPlatform, gather_layer_rows
from radixserve.plugins.hicache_storage.file import FileStorage

LAYERS, HEADS, HEAD_DIM, SLOTS = 2, 2, 4, 32
# The host pool's layout and io backend per device (on main, not yet on this branch's base)
PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * 4  # K and V, float32


def _runner(storage: str = "none", page: int = 1) -> Any:
    mc = ModelConfig.from_dict(
        {"architectures": ["X"], "hidden_size": 8, "num_attention_heads": 2,
         "num_hidden_layers": LAYERS, "vocab_size": 10, "num_key_value_heads": HEADS,
         "head_dim": HEAD_DIM}
    )  # fmt: skip
    return SimpleNamespace(
        allocator=TokenAllocator(SLOTS, page),
        req_to_token=ReqToTokenPool(2, 64),
        kv_pool=KVPool(SLOTS, LAYERS, HEADS, HEAD_DIM, torch.float32, "cpu"),
        model_config=mc,
        plugins=SimpleNamespace(names={"hicache_storage": storage}),
        platform=CpuPlatform(),
    )


def test_no_radix_cache_and_the_plain_radix_cache() -> None:
    runner = _runner()
    none = build_cache(runner, EngineConfig(disable_radix_cache=True), default_host(), "m")
    assert type(none) is NoPrefixCache
    assert none.allocator is runner.allocator and none.req_to_token is runner.req_to_token
    plain = build_cache(runner, EngineConfig(), default_host(), "m")
    assert type(plain) is RadixCache
    assert plain.allocator is runner.allocator and plain.req_to_token is runner.req_to_token


def test_the_hierarchical_cache_sized_by_ratio(caplog: pytest.LogCaptureFixture) -> None:
    runner = _runner()
    config = EngineConfig(enable_hierarchical_cache=True, hicache_ratio=2.5)
    with caplog.at_level(logging.INFO, logger="radixserve.core.cache_setup"):
        cache = build_cache(runner, config, default_host(), "/models/m")
    assert isinstance(cache, HiRadixCache)
    assert cache.allocator is runner.allocator and cache.req_to_token is runner.req_to_token
    assert cache.host.size == 80 and cache.host.layout == "layer_first"  # the CPU's default
    assert cache.host.device_pool is runner.kv_pool
    assert cache.host.layer_copy is gather_layer_rows  # the platform's per-layer loads
    assert runner.kv_pool.issue_loads == cache.host.issue_loads
    assert cache.write_policy == config.hicache_write_policy
    assert cache.storage is None
    assert cache.namespace == f"/models/m|{LAYERS}|{HEADS}|{HEAD_DIM}|torch.float32|1"
    assert caplog.messages == [
        f"hierarchical cache: host pool of 80 tokens ({80 * PER_TOKEN / 1e9:.2f} GB, "
        f"layer_first, per-layer loads), write policy {config.hicache_write_policy}, "
        "storage none"
    ]


def test_the_hierarchical_cache_sized_in_gb_and_its_page_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = _runner("file", page=4)
    config = EngineConfig(
        enable_hierarchical_cache=True, hicache_size=0.01, hicache_ratio=9.0, page_size=4,
        hicache_mem_layout="page_first",
        hicache_write_policy="write_back", hicache_storage_backend="file",
        hicache_storage_backend_extra_config=f'{{"dir": "{tmp_path}"}}',
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="radixserve.core.cache_setup"):
        cache = build_cache(runner, config, default_host(), "d")
    assert isinstance(cache, HiRadixCache)
    # 10 MB of 128-byte tokens, in whole pages of 4, less the allocator's reserved page
    assert cache.host.size == 78120 and cache.page_size == 4
    assert cache.write_policy == "write_back" and cache.host.layout == "page_first"
    assert isinstance(cache.storage, GuardedStorage) and cache.storage.name == "file"
    assert isinstance(cache.storage.backend, FileStorage)
    assert cache.storage.backend.dir == tmp_path
    assert cache.namespace == f"d|{LAYERS}|{HEADS}|{HEAD_DIM}|torch.float32|4"
    assert caplog.messages[-1].startswith(
        "hierarchical cache: host pool of 78120 tokens (0.01 GB, page_first, per-layer loads)"
    )
    assert caplog.messages[-1].endswith("write policy write_back, storage file")


def test_the_io_backend_reaches_the_host_pool() -> None:
    config = EngineConfig(enable_hierarchical_cache=True, hicache_io_backend="kernel")
    with pytest.raises(ConfigError, match="--hicache-io-backend kernel needs a CUDA device pool"):
        build_cache(_runner(), config, default_host(), "m")


@pytest.mark.parametrize(
    ("over", "size"), [({"hicache_ratio": 1.0}, 32), ({"hicache_size": 32 * PER_TOKEN / 1e9}, 32)]
)
def test_a_host_pool_no_larger_than_the_device_pool_is_refused(
    over: dict[str, float], size: int
) -> None:
    config = EngineConfig(enable_hierarchical_cache=True, **over)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as e:
        build_cache(_runner(), config, default_host(), "m")
    assert str(e.value) == (
        f"the host KV pool ({size} tokens) must be larger than the device pool "
        f"({SLOTS} tokens): raise --hicache-ratio above 1 or --hicache-size"
    )
    # one token more is enough
    more = EngineConfig(enable_hierarchical_cache=True, hicache_ratio=33 / 32)
    assert build_cache(_runner(), more, default_host(), "m").host.size == 33  # type: ignore[union-attr]


def test_the_host_pools_layout_and_io_backend_per_device() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")  # a description: no GPU needed
    unset = EngineConfig(enable_hierarchical_cache=True)
    assert host_pool_defaults(unset, cuda) == ("page_first", "kernel")
    assert host_pool_defaults(unset, cpu) == ("layer_first", "direct")
    flags = EngineConfig(hicache_mem_layout="layer_first", hicache_io_backend="direct")
    assert host_pool_defaults(flags, cuda) == ("layer_first", "direct")
    flags = EngineConfig(hicache_mem_layout="page_first", hicache_io_backend="kernel")
    assert host_pool_defaults(flags, cpu) == ("page_first", "kernel")
