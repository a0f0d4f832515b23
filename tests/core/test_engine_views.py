"""core/engine_views.py's EngineViews on parts made here (no model, no engine): each view reads
the part it names, the counters' shape, the grammar sandbox's spec, closing the transfers once.
The strategies are real StepStrategy subclasses in a real StrategyList."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from radixserve.core.config import EngineConfig
from radixserve.core.disaggregation import PrefillSide
from radixserve.core.engine_views import EngineViews
from radixserve.core.grammar_sandbox import SandboxSpec
from radixserve.core.interfaces import StepStrategy
from radixserve.core.multimodal_strategy import MultimodalStrategy
from radixserve.core.platform_settings import CORE_DEFAULTS, PlatformSettings
from radixserve.core.spec_strategy import Speculation
from radixserve.core.step_plan import SchedulerStats
from radixserve.core.strategy_list import StrategyList


class _Spec(Speculation):
    def __init__(self, num_draft: int) -> None:  # the parts the views read, no runner
        self.speculator = SimpleNamespace(num_draft=num_draft)  # type: ignore[assignment]


class _Side(PrefillSide):
    def __init__(self) -> None:
        self.connector = SimpleNamespace(wakeup_fd=9)  # type: ignore[assignment]
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class _Mm(MultimodalStrategy):
    def __init__(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"images_encoded": 3}


class _Other(StepStrategy):
    pass


class _Grammars:
    def __init__(self, backend: str) -> None:
        self.backend_name = backend
        self.specs: list[SandboxSpec] = []

    def __len__(self) -> int:
        return 2

    def isolate(self, spec: SandboxSpec) -> None:
        self.specs.append(spec)


class _Calls:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def bind_server_engine(self) -> None:
        self.calls.append("bind")

    def close(self) -> None:
        self.calls.append("close")


class Views(EngineViews):
    pass


def _views(strategies: list[StepStrategy], **config: Any) -> Views:
    v = Views()
    v.config = EngineConfig(
        model_path="/m", plugin_allow=("p",), grammar_compile_memory=300, **config
    )
    settings = PlatformSettings(
        **{n: i + 2 for i, n in enumerate(CORE_DEFAULTS)},  # type: ignore[arg-type]
        origins={n: "flag" for n in CORE_DEFAULTS},
    )
    platform, runner_calls = _Calls(), _Calls()
    v.runner = SimpleNamespace(  # type: ignore[assignment]
        model_config=SimpleNamespace(vocab_size=321),
        kv_size=4096,
        settings=settings,
        dtype=torch.bfloat16,
        kv_dtype=torch.float16,
        plugins=SimpleNamespace(names={"attention": "torch_native", "sampler": "x"}),
        platform=platform,
        close=runner_calls.close,
        calls=runner_calls.calls,
    )
    stats = SchedulerStats(prompt_tokens=10, cached_tokens=4, retractions=3, preemptions=1, steps=7)
    stats.by_kind["decode"].steps = 5
    v.scheduler = SimpleNamespace(  # type: ignore[assignment]
        running=[SimpleNamespace(rid="b"), SimpleNamespace(rid="a")],
        waiting=[SimpleNamespace(rid="c")],
        kv_accounting=lambda: {"free": 1},
        stats=stats,
        cache=SimpleNamespace(tier_stats=lambda: {"host": 2}),
        priority=SimpleNamespace(to_json=lambda: {"0": 1}),
    )
    v.grammars = _Grammars("xgrammar")  # type: ignore[assignment]
    v.strategies = StrategyList(strategies)
    v.eos_token_ids = (5, 6)
    return v


def test_the_runners_and_schedulers_views() -> None:
    v = _views([_Other()])
    assert (v.vocab_size, v.kv_size, v.max_running_requests) == (321, 4096, 2)
    assert v.settings_summary() == v.runner.settings.describe()
    assert v.settings_summary()["chunked_prefill_size"] == {"value": 4, "from": "flag"}
    names = v.plugin_names()
    assert names == {"attention": "torch_native", "sampler": "x"}
    names["attention"] = "changed"  # a copy
    assert v.runner.plugins.names["attention"] == "torch_native"
    assert (v.num_running, v.num_waiting, v.num_grammar_queue) == (2, 1, 2)
    assert v.running_rids() == ["b", "a"]
    assert v.kv_accounting() == {"free": 1}
    assert v.spec_num_draft is None and v.wakeup_fd is None


def test_numerics() -> None:
    assert _views([]).numerics() == "bfloat16 weights, float16 KV, eager decode"
    on = _views([], enable_torch_compile=True)
    object.__setattr__(on.config, "enable_deterministic_inference", True)  # past its checks
    assert on.numerics() == "bfloat16 weights, float16 KV, compiled decode, deterministic"
    q = _views([])
    object.__setattr__(q.config, "quantization", "gguf")
    assert q.numerics() == "gguf weights, float16 KV, eager decode"


def test_scheduler_counters() -> None:
    v = _views([_Other()])
    by_kind = {k: s.to_json() for k, s in v.scheduler.stats.by_kind.items()}
    assert by_kind["decode"]["steps"] == 5
    assert v.scheduler_counters() == {
        "cache_hit_rate": 0.4,
        "hicache": {"host": 2},
        "multimodal": None,
        "retractions": 3,
        "preemptions": 1,
        "priorities": {"0": 1},
        "steps": 7,
        "steps_by_kind": by_kind,
    }
    assert _views([_Mm()]).scheduler_counters()["multimodal"] == {"images_encoded": 3}


def test_speculation_and_transfers_are_read_from_the_strategies() -> None:
    side = _Side()
    v = _views([_Other(), _Spec(4), side])
    assert v.spec_num_draft == 4
    assert v.wakeup_fd == 9
    v.close_transfers()
    assert side.closed == 1 and side not in list(v.strategies)
    assert v.wakeup_fd is None
    v.close_transfers()  # once
    assert side.closed == 1
    _views([]).close_transfers()  # none: nothing to do


def test_the_platform_and_the_runner_are_told() -> None:
    v = _views([])
    v.bind_server_engine()
    assert v.runner.platform.calls == ["bind"] and v.runner.calls == []
    v.close_runner()
    assert v.runner.calls == ["close"]


def test_grammar_compiles_are_isolated_with_the_engines_spec() -> None:
    v = _views([])
    v.isolate_grammar_compiles()
    assert v.grammars.specs == [  # type: ignore[attr-defined]
        SandboxSpec(
            backend="xgrammar",
            model_dir="/m",
            vocab_size=321,
            stop_token_ids=(5, 6),
            plugin_allow=("p",),
            memory_mb=300,
        )
    ]
    assert type(v.grammars.specs[0].stop_token_ids) is tuple  # type: ignore[attr-defined]
    none = _views([])
    none.grammars = _Grammars("none")  # type: ignore[assignment]
    none.isolate_grammar_compiles()
    assert none.grammars.specs == []  # type: ignore[attr-defined]
