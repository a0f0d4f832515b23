"""HiCache prefetch (core/hicache_prefetch.py) on the CPU, float32, tiny random Llama: greedy
outputs equal the plain radix cache's with prefetch on, over the multi-turn workload of
test_hicache.py; with a storage backend whose reads the test holds back, admission under
best_effort does not wait for them and under wait_complete does; a request aborted while its
read is held frees everything; the storage tier dying mid-read degrades to recompute."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from platform_choice import CPU

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.hicache_prefetch import HiCachePrefetch
from radixserve.core.hookspecs import hookimpl
from radixserve.core.plugins import PluginHost, default_host
from radixserve.core.request import Req, ReqState, SamplingParams
from radixserve.plugins.hicache_storage.file import FileStorage

POOL = 256  # device pool, tokens
CONVS, TURNS, USER, OUT = 5, 3, 60, 6  # as test_hicache.py: history 3.9x the pool
HANG_GUARD_S = 120.0  # only stops a hung test


class HeldReads:
    """Registers hicache_storage ``held_file``: the file backend whose page reads (``get``)
    wait until the test calls ``release()``; ``reading`` is set once a read waits."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.reading = threading.Event()

    def release(self) -> None:
        self.gate.set()

    @hookimpl
    def register_hicache_storage_backends(self, register: Any) -> None:
        plugin = self

        class HeldFile(FileStorage):
            def get(self, key: str, out: Any) -> bool:
                plugin.reading.set()
                if not plugin.gate.wait(HANG_GUARD_S):
                    raise TimeoutError("the test never released the read")
                return super().get(key, out)

        register("held_file", HeldFile, description="test: reads held until released")


def _held_core(
    model_dir: Path, store: Path, held: HeldReads, policy: str, **extra: Any
) -> EngineCore:
    """Prefetch on, storage reads through the ``held_file`` backend that ``held`` controls."""
    return _core(
        model_dir, 16, PluginHost(extra_plugins=[("held", held)]),
        enable_hicache_prefetch=True, hicache_storage_prefetch_policy=policy,
        **_storage_flags(store, "held_file", **extra),
    )  # fmt: skip


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 360) for _ in range(n)]


def _core(model_dir: Path, page_size: int, host: PluginHost | None = None, **flags: Any) -> Any:
    config = EngineConfig(
        page_size=page_size, max_total_tokens=POOL, chunked_prefill_size=64,
        max_running_requests=2, plugins=(CPU,), **flags,
    )  # fmt: skip
    return EngineCore(model_dir, config, host or default_host())


def _checked_step(core: EngineCore) -> None:
    core.step()
    core.cache.check_tiers()
    acct = core.scheduler.kv_accounting()
    assert min(acct.values()) >= 0, acct


def _add(core: EngineCore, prompt: list[int], rid: str) -> Req:
    req = Req(rid, prompt, SamplingParams(max_new_tokens=OUT, temperature=0.0, ignore_eos=True))
    core.add_request(req)
    return req


def _finish(core: EngineCore, req: Req) -> Req:
    # Bounded by time, not by a step count: a request waiting for its storage read
    # (wait_complete) takes as many (empty) steps as the read thread needs on this machine.
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        if req.finished and not core.has_work():
            break
        _checked_step(core)
    core.scheduler.check_no_leak()
    assert req.finished and req.finish_reason is not None
    assert req.finish_reason.type != "abort"
    return req


def _conversations(core: EngineCore) -> list[list[int]]:
    histories: list[list[int]] = [[] for _ in range(CONVS)]
    outputs: list[list[int]] = []
    for turn in range(TURNS):
        for c in range(CONVS):
            prompt = histories[c] + _tokens(100 * c + turn, USER)
            req = _finish(core, _add(core, prompt, f"c{c}t{turn}"))
            outputs.append(list(req.output_ids))
            histories[c] = prompt + list(req.output_ids)
    return outputs


def _storage_flags(store: Path, backend: str = "file", **extra: Any) -> dict[str, Any]:
    return {
        "enable_hierarchical_cache": True,
        "hicache_ratio": 1.5,  # the host pool holds less than the history: storage serves
        "hicache_storage_backend": backend,
        "hicache_storage_backend_extra_config": json.dumps({"dir": str(store), **extra}),
    }


def _prefetch(core: EngineCore) -> HiCachePrefetch:
    return next(s for s in core.strategies if isinstance(s, HiCachePrefetch))


@pytest.mark.parametrize(
    ("page_size", "storage"), [(1, False), (16, True)], ids=["host", "storage"]
)  # fmt: skip
def test_outputs_equal_with_prefetch_on_and_off(
    tiny_llama_dir: Path, tmp_path: Path, page_size: int, storage: bool
) -> None:
    off = _core(tiny_llama_dir, page_size)
    reference = _conversations(off)
    off.shutdown()
    flags: dict[str, Any] = (
        _storage_flags(tmp_path / "kv") if storage
        else {"enable_hierarchical_cache": True, "hicache_ratio": 8.0}
    )  # fmt: skip
    on = _core(
        tiny_llama_dir, page_size, enable_hicache_prefetch=True,
        hicache_storage_prefetch_policy="wait_complete", **flags,
    )  # fmt: skip
    outputs = _conversations(on)
    stats = on.cache.tier_stats()
    on.shutdown()
    assert outputs == reference
    assert stats is not None
    # each later turn's history went back to the device while its request was queued
    assert stats["prefetch_device_tokens"] >= CONVS * (TURNS - 1) * USER // 2
    if storage:
        assert stats["prefetch_storage_tokens"] > 0
        assert stats["storage_hit_tokens"] == 0  # admission itself never read storage


def _stored_prompt(model_dir: Path, store: Path) -> tuple[list[int], list[int]]:
    """A prompt whose pages a first engine wrote to ``store``, and its outputs."""
    first = _core(model_dir, 16, **_storage_flags(store))
    prompt = _tokens(7, 150)
    out = list(_finish(first, _add(first, prompt, "first")).output_ids)
    first.shutdown()
    return prompt, out


@pytest.mark.parametrize(
    ("policy", "extra", "waits"),
    [
        ("best_effort", {}, False),
        ("wait_complete", {}, True),
        ("timeout", {"prefetch_timeout_base": 0, "prefetch_timeout_per_ki_token": 0}, False),
    ],
)
def test_admission_waits_for_held_reads_only_under_wait_complete(
    tiny_llama_dir: Path, tmp_path: Path, policy: str, extra: dict[str, Any], waits: bool
) -> None:
    store = tmp_path / "kv"
    prompt, expected = _stored_prompt(tiny_llama_dir, store)
    held = HeldReads()
    core = _held_core(tiny_llama_dir, store, held, policy, **extra)
    try:
        req = _add(core, prompt, "again")
        assert held.reading.wait(HANG_GUARD_S)  # the read started, and is held
        for _ in range(20):
            _checked_step(core)
        assert (req.state is ReqState.WAITING) == waits
        held.release()
        _finish(core, req)
        stats = core.cache.tier_stats()
    finally:
        held.release()
        core.shutdown()
    assert req.output_ids == expected
    assert stats is not None
    if waits:  # it started with the whole stored prefix on the host
        assert req.cached_tokens == 144 and stats["prefetch_storage_tokens"] == 144
    else:  # it started without: nothing had arrived
        assert req.cached_tokens == 0 and stats["prefetch_storage_tokens"] == 0


def test_an_abort_during_a_held_read_frees_everything(tiny_llama_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    prompt, expected = _stored_prompt(tiny_llama_dir, store)
    held = HeldReads()
    core = _held_core(tiny_llama_dir, store, held, "wait_complete")
    try:
        prefetch = _prefetch(core)
        req = _add(core, prompt, "doomed")
        assert held.reading.wait(HANG_GUARD_S)
        _checked_step(core)
        assert core.abort("doomed") is req and req.finish_reason is not None
        assert req.finish_reason.type == "abort" and not core.has_work()
        core.scheduler.check_no_leak()  # nothing held on the device or the host
        assert not prefetch.queued
        held.release()  # the read ends and its pages are dropped, never landed
        again = _finish(core, _add(core, prompt, "again"))
        stats = core.cache.tier_stats()
    finally:
        held.release()
        core.shutdown()
    assert stats is not None and stats["prefetch_cancelled"] == 1
    assert again.output_ids == expected and again.cached_tokens == 144
    assert stats["prefetch_storage_tokens"] == 144  # the second request's read only


def test_storage_dying_during_a_read_degrades_to_recompute(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "kv"
    prompt, expected = _stored_prompt(tiny_llama_dir, store)
    held = HeldReads()
    core = _held_core(tiny_llama_dir, store, held, "wait_complete")
    try:
        req = _add(core, prompt, "again")
        assert held.reading.wait(HANG_GUARD_S)
        _checked_step(core)
        shutil.rmtree(store)  # the tier dies under the read: its directory becomes a file
        store.write_text("not a directory")
        held.release()
        _finish(core, req)
        stats = core.cache.tier_stats()
    finally:
        held.release()
        core.shutdown()
    assert req.output_ids == expected and req.cached_tokens == 0
    assert stats is not None and stats["storage_errors"] > 0


def test_prefetch_needs_the_hierarchical_cache() -> None:
    with pytest.raises(ConfigError, match="needs --enable-hierarchical-cache"):
        EngineConfig(enable_hicache_prefetch=True)
    with pytest.raises(ConfigError, match="hicache_storage_prefetch_policy"):
        EngineConfig(enable_hierarchical_cache=True, hicache_storage_prefetch_policy="eager")
