"""HiCache's loads layer by layer: the host pool queues a step's loads and issues them together
before the forward, a layer at a time through the platform's gather (``CopiesHostKVLayers``);
the device pool hands the forward one event per layer, and a ``WaitsForKVLayers`` model waits
for each just before that layer runs. On the CPU the copies are in order (no events); the
waits are checked here with recording events, the CUDA streams in the gpu-marked test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_fingerprints import kv_tokens, write_fingerprints
from platform_choice import CPU

from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.hicache import HiRadixCache, HiTreeNode
from radixserve.core.hicache_pool import HostKVPool
from radixserve.core.memory import KVPool, ReqToTokenPool, TokenAllocator
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, SamplingParams
from radixserve.plugins.hardware.cpu import gather_layer_rows

LAYERS, HEADS, HEAD_DIM = 3, 1, 2


class Event:
    """A stand-in for a CUDA event: ``wait()`` appends its name to the shared log."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait(self) -> None:
        self.log.append(self.name)


class RecordingCopy:
    """The CPU gather, recording each call's row count."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, *args: torch.Tensor) -> None:
        self.rows.append(len(args[2]))
        gather_layer_rows(*args)


def make(copy: RecordingCopy, layout: str = "layer_first") -> HiRadixCache:
    dev = KVPool(16, LAYERS, HEADS, HEAD_DIM, torch.float32, "cpu")
    host = HostKVPool(dev, 48, 1, layout, "direct", layer_copy=copy)
    return HiRadixCache(TokenAllocator(16, 1), ReqToTokenPool(2, 64), host, "write_through")


def demoted(cache: HiRadixCache, *prefixes: list[int]) -> list[HiTreeNode]:
    """Each prefix inserted with its fingerprints, then all evicted to the host."""
    for tokens in prefixes:
        slots = cache.allocator.alloc(len(tokens))
        assert slots is not None
        write_fingerprints(cache, slots, tokens)
        cache.insert(tokens, slots)
    cache.evict(sum(len(t) for t in prefixes))
    nodes = [cache._root(None).children[cache._child_key(t)] for t in prefixes]
    assert all(isinstance(n, HiTreeNode) and n.value is None for n in nodes)
    return nodes  # type: ignore[return-value]


def test_the_device_pool_waits_per_layer_or_for_all() -> None:
    log: list[str] = []
    pool = KVPool(8, LAYERS, HEADS, HEAD_DIM, torch.float32, "cpu")
    issued: list[int] = []
    pool.issue_loads = lambda: issued.append(1)
    pool.layer_loads = [Event(f"layer {i}", log) for i in range(LAYERS)]
    pool.prepare_loads(per_layer=True)  # the model waits: nothing yet
    assert issued == [1] and log == [] and pool.layer_loads is not None
    pool.wait_layer(1)
    assert log == ["layer 1"]
    pool.wait_loads()  # the last layer's event follows the others on its stream
    assert log == ["layer 1", f"layer {LAYERS - 1}"] and pool.layer_loads is None
    pool.wait_layer(0)
    pool.wait_loads()
    assert log == ["layer 1", f"layer {LAYERS - 1}"]  # nothing pending: no waits
    pool.layer_loads = [Event(f"layer {i}", log) for i in range(LAYERS)]
    pool.prepare_loads(per_layer=False)  # a model that does not wait: all now
    assert log[-1] == f"layer {LAYERS - 1}" and pool.layer_loads is None


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_steps_loads_go_out_together_a_layer_at_a_time(layout: str) -> None:
    copy = RecordingCopy()
    cache = make(copy, layout)
    a, b = [1, 2, 3, 4], [5, 6, 7]
    demoted(cache, a, b)
    ma, mb = cache.match_prefix(a), cache.match_prefix(b)
    assert copy.rows == []  # queued until the step's forward
    assert cache.host.queued(ma.last_node.load_batch)  # type: ignore[attr-defined]
    cache.host.device_pool.prepare_loads(per_layer=True)
    assert copy.rows == [len(a) + len(b)] * LAYERS  # one gather per layer, both loads in it
    assert not cache.host.queued(ma.last_node.load_batch)  # type: ignore[attr-defined]
    assert kv_tokens(cache, ma.kv_indices) == a and kv_tokens(cache, mb.kv_indices) == b
    cache.check_tiers()


def test_evicting_a_node_whose_load_is_queued_issues_it_first() -> None:
    """Its slots go back to the allocator only once the queued copy into them went out: a
    later writer of those slots (a step, another load) then comes after it."""
    copy = RecordingCopy()
    cache = make(copy)
    a = [1, 2, 3, 4]
    (node,) = demoted(cache, a)
    match = cache.match_prefix(a)
    slots = match.kv_indices.clone()
    assert match.last_node is node and cache.host.queued(node.load_batch)
    assert cache.evict(len(a)) == len(a)  # unlocked: evicted again before any step
    assert copy.rows == [len(a)] * LAYERS and not cache.host.queued(node.load_batch)
    assert kv_tokens(cache, slots) == a  # the load landed before the slots were freed
    cache.check_tiers()


def test_evicting_a_node_whose_load_went_out_leaves_the_queue_alone() -> None:
    """Only a node of the queued batch issues it: one loaded in an earlier step (here the
    second batch of the run) is evicted without sending the next step's loads early."""
    copy = RecordingCopy()
    cache = make(copy)
    x, a, b = [1, 2], [3, 4, 5], [6, 7, 8, 9]
    demoted(cache, x, a, b)
    issue = cache.host.device_pool.prepare_loads
    cache.match_prefix(x)
    issue(per_layer=True)
    node = cache.match_prefix(a).last_node
    issue(per_layer=True)
    cache.match_prefix(b)  # queued for the next step
    assert copy.rows == [len(x)] * LAYERS + [len(a)] * LAYERS
    assert isinstance(node, HiTreeNode) and not cache.host.queued(node.load_batch)
    freed = cache.evict(len(x) + len(a))  # x and a: the LRU device leaves
    assert freed >= len(a) and node.value is None
    assert copy.rows == [len(x)] * LAYERS + [len(a)] * LAYERS  # b's load still queued
    issue(per_layer=True)
    assert copy.rows[-LAYERS:] == [len(b)] * LAYERS
    cache.check_tiers()


def test_a_cache_flush_issues_queued_loads_first() -> None:
    copy = RecordingCopy()
    cache = make(copy)
    (node,) = demoted(cache, [1, 2, 3])
    cache.match_prefix([1, 2, 3])
    cache.flush()
    assert copy.rows == [3] * LAYERS and not cache.host.queued(node.load_batch)


def test_the_decoder_waits_for_each_layers_kv_before_running_it(tiny_llama_dir: Path) -> None:
    """The events the device pool holds at a step are waited on in layer order, each just
    before its layer runs, and the last once more after the forward."""
    config = EngineConfig(max_total_tokens=256, plugins=(CPU,))
    core = EngineCore(tiny_llama_dir, config, default_host())
    try:
        runner = core.runner
        assert runner.waits_for_kv_layers
        log: list[str] = []
        layers = runner.model.layers
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda *_, i=i: log.append(f"run {i}"))
        runner.kv_pool.layer_loads = [Event(f"wait {i}", log) for i in range(len(layers))]
        req = Req("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=1, ignore_eos=True))
        core.add_request(req)
        while core.has_work():
            core.step()
        n = len(layers)
        want = [x for i in range(n) for x in (f"wait {i}", f"run {i}")] + [f"wait {n - 1}"]
        assert log[: len(want)] == want
        assert runner.kv_pool.layer_loads is None
        assert set(log[len(want) :]) <= {f"run {i}" for i in range(n)}  # later steps: no waits
    finally:
        core.shutdown()
