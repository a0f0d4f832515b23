"""The hierarchical cache (core/hicache.py) on the CPU, float32, tiny random Llama: greedy
outputs equal the plain radix cache's over multi-turn conversations whose history is several
times the device pool, every later turn's history having been demoted to the host and loaded
back; the tiers' bookkeeping checked after every step; the file storage tier across an engine
restart and while it fails."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from platform_choice import CPU

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.hicache import HiRadixCache
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, SamplingParams

POOL = 256  # device pool, tokens
CONVS, TURNS, USER, OUT = 5, 3, 60, 6  # history at the end: 5 x 198 tokens, 3.9x the pool


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 360) for _ in range(n)]


def _core(model_dir: Path, page_size: int, **flags: Any) -> EngineCore:
    config = EngineConfig(
        page_size=page_size, max_total_tokens=POOL, chunked_prefill_size=64,
        max_running_requests=2, plugins=(CPU, *flags.pop("plugins", ())), **flags,
    )  # fmt: skip
    return EngineCore(model_dir, config, default_host())


def _run(core: EngineCore, prompt: list[int], rid: str) -> Req:
    req = Req(rid, prompt, SamplingParams(max_new_tokens=OUT, temperature=0.0, ignore_eos=True))
    core.add_request(req)
    for _ in range(1000):
        if not core.has_work():
            break
        core.step()
        core.cache.check_tiers()
        acct = core.scheduler.kv_accounting()
        assert min(acct.values()) >= 0, acct
    core.scheduler.check_no_leak()
    assert req.finished
    return req


def _conversations(core: EngineCore, check_demoted: bool) -> list[list[int]]:
    """Turn by turn, each conversation in order; its history is the prompts and outputs so
    far. With ``check_demoted``, every later turn's history was off the device before the turn
    and came back from the host: its cached tokens cover the whole history's pages."""
    histories: list[list[int]] = [[] for _ in range(CONVS)]
    outputs: list[list[int]] = []
    p = core.runner.allocator.page_size
    for turn in range(TURNS):
        for c in range(CONVS):
            prompt = histories[c] + _tokens(100 * c + turn, USER)
            if check_demoted and turn:
                assert _off_device(core.cache, histories[c]), (c, turn)
            req = _run(core, prompt, f"c{c}t{turn}")
            if check_demoted and turn:
                assert req.cached_tokens >= len(histories[c]) - len(histories[c]) % p - p
            outputs.append(list(req.output_ids))
            histories[c] = prompt + list(req.output_ids)
    return outputs


def _off_device(cache: Any, tokens: list[int]) -> bool:
    """Whether some of ``tokens``' cached pages are only in host memory now."""
    node = cache._root(None)
    while tokens:
        child = node.children.get(cache._child_key(tokens))
        if child is None:
            return False
        if child.value is None:
            return child.host_value is not None
        node, tokens = child, tokens[len(child.key) :]
    return False


_REFERENCE: dict[int, list[list[int]]] = {}


def _reference(model_dir: Path, page_size: int) -> list[list[int]]:
    if page_size not in _REFERENCE:
        core = _core(model_dir, page_size)
        _REFERENCE[page_size] = _conversations(core, check_demoted=False)
        core.shutdown()
    return _REFERENCE[page_size]


@pytest.mark.parametrize(
    ("page_size", "overlap", "policy"),
    [(1, False, "write_through"), (16, True, "write_through"), (1, True, "write_back")],
)  # fmt: skip
def test_outputs_equal_the_radix_cache_with_history_beyond_the_pool(
    tiny_llama_dir: Path, page_size: int, overlap: bool, policy: str
) -> None:
    core = _core(
        tiny_llama_dir, page_size, enable_hierarchical_cache=True, hicache_ratio=8.0,
        hicache_write_policy=policy, enable_overlap_schedule=overlap,
    )  # fmt: skip
    assert isinstance(core.cache, HiRadixCache)
    outputs = _conversations(core, check_demoted=True)
    stats = core.cache.tier_stats()
    assert stats is not None
    core.shutdown()
    assert outputs == _reference(tiny_llama_dir, page_size)
    history = CONVS * TURNS * (USER + OUT)
    assert history > 3 * POOL
    # every turn after the first reloaded at least its previous history (checked per turn)
    assert stats["host_hit_tokens"] >= CONVS * (TURNS - 1) * USER
    assert stats["demoted_tokens"] >= stats["host_hit_tokens"] - POOL


def test_selective_policy_drops_cold_prefixes_and_keeps_outputs(tiny_llama_dir: Path) -> None:
    core = _core(
        tiny_llama_dir, 16, enable_hierarchical_cache=True,
        hicache_write_policy="write_through_selective",
    )  # fmt: skip
    outputs = _conversations(core, check_demoted=False)
    stats = core.cache.tier_stats()
    core.shutdown()
    assert outputs == _reference(tiny_llama_dir, 16)
    assert stats is not None and stats["dropped_tokens"] > 0


def _file_flags(tmp: Path) -> dict[str, Any]:
    return {
        "enable_hierarchical_cache": True,
        "hicache_ratio": 1.5,
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": json.dumps({"dir": str(tmp)}),
    }


def test_file_storage_serves_a_restarted_engine(tiny_llama_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    first = _core(tiny_llama_dir, 16, **_file_flags(store), hicache_mem_layout="page_first")
    prompt = _tokens(7, 150)
    before = _run(first, prompt, "a")
    first.shutdown()
    assert any(store.glob("*.kv"))
    second = _core(tiny_llama_dir, 16, **_file_flags(store), hicache_mem_layout="page_first")
    again = _run(second, prompt, "b")
    stats = second.cache.tier_stats()
    assert again.cached_tokens == 144 and again.output_ids == before.output_ids
    assert stats is not None and stats["storage_hit_tokens"] == 144
    assert second.clear_cache_storage() and not any(store.glob("*.kv"))
    second.shutdown()


def test_a_failing_storage_tier_degrades_to_recompute(tiny_llama_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    core = _core(tiny_llama_dir, 16, **_file_flags(store))
    outputs = []
    for turn in range(TURNS):
        if turn == 1:  # the tier dies: its directory becomes a file
            shutil.rmtree(store)
            store.write_text("not a directory")
        outputs.append(_run(core, _tokens(turn, 120), f"t{turn}").output_ids)
    for turn in range(TURNS):  # again: what the host pool lost is recomputed
        assert _run(core, _tokens(turn, 120), f"again{turn}").output_ids == outputs[turn]
    stats = core.cache.tier_stats()
    core.shutdown()
    assert stats is not None and stats["storage_errors"] > 0


def test_refused_combinations_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(enable_hierarchical_cache=True, speculative_algorithm="ngram")
    with pytest.raises(ConfigError, match="disaggregation"):
        EngineConfig(enable_hierarchical_cache=True, disaggregation_mode="decode")
    with pytest.raises(ConfigError, match="hicache_write_policy"):
        EngineConfig(hicache_write_policy="sometimes")
    with pytest.raises(ConfigError, match="JSON"):
        EngineConfig(hicache_storage_backend_extra_config="{")


def test_the_host_pool_must_exceed_the_device_pool(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="larger than the device pool"):
        _core(tiny_llama_dir, 1, enable_hierarchical_cache=True, hicache_ratio=0.5)
    with pytest.raises(ConfigError, match="kernel needs a CUDA"):
        _core(tiny_llama_dir, 1, enable_hierarchical_cache=True, hicache_io_backend="kernel")


def test_an_insert_over_a_host_only_prefix_adopts_the_callers_slots(tiny_llama_dir: Path) -> None:
    """A key whose cached prefix lives only in host memory: that node takes the caller's slots
    for its own span as its device copy, and no slot counts as already cached (the caller keeps
    them all; counting them would free slots the tree now holds)."""
    core = _core(tiny_llama_dir, 1, enable_hierarchical_cache=True, hicache_ratio=4.0)
    cache = core.cache
    assert isinstance(cache, HiRadixCache)
    prefix, rest = _tokens(7, 8), _tokens(8, 4)
    first = cache.allocator.alloc(8)
    assert first is not None
    cache.insert(prefix, first)
    assert cache.evict(8) == 8
    node = cache._root(None).children[cache._child_key(prefix)]
    assert node.value is None and node.host_value is not None  # demoted, host only
    slots = cache.allocator.alloc(12)
    assert slots is not None
    assert cache.insert(prefix + rest, slots) == 0
    assert node.value is not None and node.value.tolist() == slots[:8].tolist()
    assert cache.match_prefix(prefix + rest).kv_indices.tolist() == slots.tolist()
    cache.check_tiers()
    core.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_layer_loads_give_the_whole_loads_outputs(
    tiny_llama_dir: Path, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA (triton attention, float32, overlap, CUDA graphs) the per-layer loads (a kernel
    reading pinned host memory; each layer's attention waits for its copy) give the outputs
    of whole loads by the copy engine: same matches, same kernels, so a layer read before its
    copy landed shows as a difference."""

    def run(layer_loads: bool) -> list[list[int]]:
        monkeypatch.setenv("RADIXSERVE_HICACHE_LAYER_LOADS", "1" if layer_loads else "0")
        config = EngineConfig(
            page_size=page_size, max_total_tokens=POOL, chunked_prefill_size=64,
            max_running_requests=2, plugins=("hardware=cuda",), dtype="float32",
            enable_hierarchical_cache=True, hicache_ratio=8.0, enable_overlap_schedule=True,
        )  # fmt: skip
        core = EngineCore(tiny_llama_dir, config, default_host())
        try:
            assert isinstance(core.cache, HiRadixCache)
            assert (core.cache.host.layer_copy is not None) == layer_loads
            return _conversations(core, check_demoted=True)
        finally:
            core.shutdown()

    assert run(True) == run(False)
