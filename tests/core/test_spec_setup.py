"""core/spec_setup.py on parts made here (no model): the plugin's algorithm and its memory
needs, tensor parallelism refused for all but n-gram chains, the Speculator and Speculation
built from the config and runner, the hidden layers kept, and when the device loop runs."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixserve.core.config import ConfigError
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import SpeculativeAlgorithm, SpeculativeContext
from radixserve.core.plugins import PluginHost
from radixserve.core.spec_adaptive import AdaptiveDrafting
from radixserve.core.spec_loop import DeviceVerify, SpecLoop
from radixserve.core.spec_setup import algorithm_for, build
from radixserve.core.spec_strategy import Speculation


class Algo(SpeculativeAlgorithm):
    """Records what the setup gives it; offers a device cycle for up to ``batch`` requests."""

    drafts_trees = True

    def __init__(
        self, layers: tuple[int, ...] = (), capturable: bool = False, cycle: bool = True
    ) -> None:
        self.capture_hidden_layers = layers
        self.target_hidden_capturable = capturable
        self.offers_cycle = cycle
        self.contexts: list[SpeculativeContext] = []
        self.cycles: list[tuple[DeviceVerify, int]] = []

    def memory_needs(self, config: Any, host: Any, dtype: torch.dtype) -> tuple[int, int]:
        self.asked = (config, host)
        return (1000, 24) if dtype == torch.float16 else (1, 2)

    def setup(self, context: SpeculativeContext) -> None:
        self.contexts.append(context)

    def propose(self, reqs: Any, max_drafts: Any) -> list[Any]:
        return []

    def target_hidden(self, batch: Any) -> None:
        pass

    def device_cycle(self, verify: Any, max_batch: int) -> Any:
        self.cycles.append((verify, max_batch))
        return SimpleNamespace(k=3, max_batch=max_batch) if self.offers_cycle else None


def _host(algo: Algo) -> PluginHost:
    class Plugin:
        @hookimpl
        def register_speculative_algorithms(self, register: Any) -> None:
            register("mine", lambda: algo)

    return PluginHost(load_entry_points=False, extra_plugins=[("mine", Plugin())])


def test_the_algorithm_and_its_memory_needs() -> None:
    algo = Algo()
    host = _host(algo)
    cfg = SimpleNamespace(speculative_eagle_topk=2)
    assert algorithm_for(host, {"speculative": "mine"}, cfg, torch.float16, 1) == (algo, 1000, 24)
    assert algorithm_for(host, {"speculative": "mine"}, cfg, torch.float32, 1)[1:] == (1, 2)
    assert algo.asked == (cfg, host)


@pytest.mark.parametrize(("name", "topk"), [("ngram", 2), ("standalone", 1), ("eagle", 1)])
def test_tensor_parallelism_refuses_all_but_ngram_chains(name: str, topk: int) -> None:
    cfg = SimpleNamespace(speculative_eagle_topk=topk)
    with pytest.raises(ConfigError) as e:
        algorithm_for(
            PluginHost(load_entry_points=False), {"speculative": name}, cfg, torch.float32, 2
        )
    assert str(e.value) == (
        f"speculative decoding ({name}, speculative_eagle_topk={topk}) does not run with "
        "tp_size=2 yet (only ngram chains do); drop one of them"
    )


def test_what_tensor_parallelism_lets_through() -> None:
    host = PluginHost()
    chains = SimpleNamespace(speculative_eagle_topk=1)
    algorithm, weights, kv = algorithm_for(host, {"speculative": "ngram"}, chains, torch.float32, 2)
    assert type(algorithm).__module__ == "radixserve.plugins.speculative.ngram"
    assert (weights, kv) == (0, 0)
    none = algorithm_for(
        host, {"speculative": "none"}, SimpleNamespace(speculative_eagle_topk=3), torch.float32, 4
    )
    assert none[1:] == (0, 0)


def _config(**over: Any) -> Any:
    values = dict(
        draft_depth=3,
        tree_nodes=0,
        speculative_simulate_accept_len=None,
        random_seed=11,
        speculative_disable_pause=False,
        speculative_adaptive=False,
        page_size=2,
        disable_speculative_loop=False,
        enable_speculative_loop=False,
    )
    return SimpleNamespace(**{**values, **over})


def _core(algo: Algo, name: str = "mine", **over: Any) -> Any:
    kept: list[Any] = []
    runner_over = {
        k: over.pop(k) for k in ("asynchronous", "ranks", "on_device", "on_host") if k in over
    }
    runner = SimpleNamespace(
        plugins=SimpleNamespace(names={"speculative": name, "attention": "att"}),
        reservation=SimpleNamespace(algorithm=algo),
        model_config=SimpleNamespace(vocab_size=77),
        platform=SimpleNamespace(asynchronous=runner_over.get("asynchronous", False)),
        dtype=torch.bfloat16,
        device="cpu",
        kv_size=64,
        req_to_token=object(),
        model=object(),
        allocator=SimpleNamespace(free_counts=len),
        settings=SimpleNamespace(speculative_disable_batch_size=9),
        capabilities=SimpleNamespace(
            keep_hidden_layers=lambda layers, consumer: kept.append((layers, consumer)),
            uniform_rows=True,
        ),
        ranks=SimpleNamespace(size=runner_over.get("ranks", 1)),
        attention=SimpleNamespace(
            prepares_verify_on_device=runner_over.get("on_device", True),
            plans_decode_on_host=runner_over.get("on_host", False),
        ),
        kv_pool=object(),
        kept=kept,
    )
    return SimpleNamespace(
        runner=runner,
        config=_config(**over),
        eos_token_ids=(1, 2),
        max_context=500,
        overlap=True,
        scheduler=object(),
    )


def test_no_speculation() -> None:
    algo = Algo()
    assert build(_core(algo, "none"), PluginHost(load_entry_points=False), "/m") is None  # type: ignore[arg-type]
    assert algo.contexts == []


def test_the_plugin_is_set_up_with_the_engines_parts() -> None:
    algo = Algo()
    core = _core(algo)
    host = PluginHost(load_entry_points=False)
    build(core, host, "/models/m")  # type: ignore[arg-type]
    r = core.runner
    assert algo.contexts == [
        SpeculativeContext(
            config=core.config,
            model_config=r.model_config,
            model_path="/models/m",
            host=host,
            platform=r.platform,
            dtype=torch.bfloat16,
            device="cpu",
            attention="att",
            kv_size=64,
            page_size=2,
            req_to_token=r.req_to_token,
            eos_token_ids=(1, 2),
            target_model=r.model,
            free_counts=len,
        )
    ]


def test_the_speculator_and_the_strategy() -> None:
    algo = Algo()
    core = _core(algo)
    host = PluginHost(load_entry_points=False)
    strategy = build(core, host, "/m")  # type: ignore[arg-type]
    assert isinstance(strategy, Speculation)
    sp = strategy.speculator
    assert (sp.algorithm, sp.name, sp.num_draft, sp.disable_batch_size, sp.vocab_size) == (
        algo,
        "mine",
        3,
        9,
        77,
    )
    assert sp.simulate_accept_len is None and sp.tree_nodes == 0 and sp.adaptive is None
    assert sp.pause_unprofitable is True
    assert sp._rng.random() == random.Random(11).random()
    assert (strategy.runner, strategy.max_context, strategy.overlap, strategy.host) == (
        core.runner,
        500,
        True,
        host,
    )
    assert strategy.uniform is True
    assert core.runner.kept == []  # no layers to keep


def test_the_speculators_options_from_the_config() -> None:
    core = _core(
        Algo(),
        tree_nodes=6,
        speculative_simulate_accept_len=2.5,
        speculative_disable_pause=True,
        speculative_adaptive=True,
    )
    strategy = build(core, PluginHost(load_entry_points=False), "/m")  # type: ignore[arg-type]
    assert strategy is not None
    sp = strategy.speculator
    assert (sp.tree_nodes, sp.simulate_accept_len, sp.pause_unprofitable) == (6, 2.5, False)
    assert isinstance(sp.adaptive, AdaptiveDrafting)
    assert (sp.adaptive.max_draft, sp.adaptive.tree_nodes) == (3, 6)
    assert strategy.loop is None  # trees and simulated acceptance: no device loop


def test_the_hidden_layers_to_keep() -> None:
    algo = Algo((1, 3))
    core = _core(algo)
    build(core, PluginHost(load_entry_points=False), "/m")  # type: ignore[arg-type]
    assert core.runner.kept == [((1, 3), None)]
    assert type(core.runner.kept[0][0]) is tuple
    capturable = Algo([2], capturable=True)  # type: ignore[arg-type]
    core = _core(capturable)
    build(core, PluginHost(load_entry_points=False), "/m")  # type: ignore[arg-type]
    assert core.runner.kept == [((2,), capturable.target_hidden)]
    assert type(core.runner.kept[0][0]) is tuple
    core = _core(Algo((1,)))
    core.runner.capabilities.keep_hidden_layers = None  # the executor keeps none
    assert build(core, PluginHost(load_entry_points=False), "/m") is not None  # type: ignore[arg-type]


def test_the_device_loop_where_asked_on_a_synchronous_device(
    caplog: pytest.LogCaptureFixture,
) -> None:
    algo = Algo((4,))
    core = _core(algo, enable_speculative_loop=True)
    with caplog.at_level(logging.INFO, logger="radixserve.core.spec_setup"):
        strategy = build(core, PluginHost(load_entry_points=False), "/m")  # type: ignore[arg-type]
    assert strategy is not None and isinstance(strategy.loop, SpecLoop)
    loop = strategy.loop
    assert (loop.scheduler, loop.speculator, loop.max_context) == (
        core.scheduler,
        strategy.speculator,
        500,
    )
    assert loop.cycle.max_batch == 4  # min(LOOP_BATCH, disable batch size 9)
    [(verify, max_batch)] = algo.cycles
    assert max_batch == 4
    r = core.runner
    assert (verify.model, verify.attention, verify.kv_pool, verify.req_to_token) == (
        r.model,
        r.attention,
        r.kv_pool,
        r.req_to_token,
    )
    assert verify.capture_layers == (4,) and verify.consumer == algo.target_hidden
    assert caplog.messages == ["speculation loops on the device for up to 4 requests"]
    small = _core(Algo(), enable_speculative_loop=True)
    small.runner.settings.speculative_disable_batch_size = 2
    strategy = build(small, PluginHost(load_entry_points=False), "/m")  # type: ignore[arg-type]
    assert strategy is not None and strategy.loop is not None
    assert strategy.loop.cycle.max_batch == 2


@pytest.mark.parametrize(
    ("over", "runs"),
    [
        ({}, False),  # synchronous and not asked
        ({"asynchronous": True}, True),
        ({"asynchronous": True, "disable_speculative_loop": True}, False),
        ({"asynchronous": True, "ranks": 2}, False),
        ({"asynchronous": True, "on_device": False}, False),
        ({"asynchronous": True, "on_host": True}, False),
        ({"enable_speculative_loop": True, "on_device": False, "on_host": True}, True),
        ({"asynchronous": True, "tree_nodes": 4}, False),
        ({"asynchronous": True, "speculative_simulate_accept_len": 2.0}, False),
    ],
)
def test_when_the_device_loop_runs(over: dict[str, Any], runs: bool) -> None:
    algo = Algo()
    strategy = build(_core(algo, **over), PluginHost(load_entry_points=False), "/m")  # type: ignore[arg-type]
    assert strategy is not None
    assert (strategy.loop is not None) is runs
    assert len(algo.cycles) == int(runs)


def test_no_loop_where_the_plugin_offers_no_cycle() -> None:
    algo = Algo(cycle=False)
    strategy = build(_core(algo, asynchronous=True), PluginHost(load_entry_points=False), "/m")  # type: ignore[arg-type]
    assert strategy is not None and strategy.loop is None and len(algo.cycles) == 1
