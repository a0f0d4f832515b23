"""core/deterministic.py and core/platform_settings.py alone (no engine): the default seed,
switching a part to its batch-invariant mode or refusing one without it, and the resolved
platform settings' description."""

from __future__ import annotations

import dataclasses

import pytest

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.deterministic import default_seed, make_batch_invariant
from radixserve.core.platform_settings import CORE_DEFAULTS, PlatformSettings


class Switchable:
    def __init__(self) -> None:
        self.calls = 0

    def set_batch_invariant(self) -> None:
        self.calls += 1


def test_the_default_seed_only_in_deterministic_mode() -> None:
    assert default_seed(EngineConfig(random_seed=5)) is None
    assert default_seed(EngineConfig(random_seed=5, enable_deterministic_inference=True)) == 5
    assert default_seed(EngineConfig(enable_deterministic_inference=True)) == 0


def test_a_part_is_switched_once_in_deterministic_mode_only() -> None:
    part = Switchable()
    make_batch_invariant(part, "the model", EngineConfig())
    assert part.calls == 0
    make_batch_invariant(part, "the model", EngineConfig(enable_deterministic_inference=True))
    assert part.calls == 1


def test_a_part_without_the_mode_is_refused_by_name() -> None:
    on = EngineConfig(enable_deterministic_inference=True)
    make_batch_invariant(object(), "the model", EngineConfig())  # off: not looked at
    with pytest.raises(ConfigError) as e:
        make_batch_invariant(object(), "attention backend 'x'", on)
    assert str(e.value) == (
        "--enable-deterministic-inference: attention backend 'x' has no batch-invariant mode "
        "(docs/deterministic.md lists the backends and models that do)"
    )


def test_the_core_defaults() -> None:
    assert CORE_DEFAULTS == {
        "max_running_requests": 64,
        "mem_fraction_static": 0.2,
        "chunked_prefill_size": 1024,
        "cuda_graph_max_bs": 256,
        "prefill_shrink_after_decodes": 0,
        "prefill_gather_steps": 0,
        "speculative_disable_batch_size": 32,
    }
    fields = [f.name for f in dataclasses.fields(PlatformSettings)]
    assert fields == [*CORE_DEFAULTS, "origins"]


def test_describe_gives_each_setting_its_value_and_origin() -> None:
    values = {name: i + 1 for i, name in enumerate(CORE_DEFAULTS)}
    origins = {name: f"from {i}" for i, name in enumerate(CORE_DEFAULTS)}
    settings = PlatformSettings(**values, origins={**origins, "unrelated": "x"})
    assert settings.describe() == {
        name: {"value": values[name], "from": origins[name]} for name in CORE_DEFAULTS
    }
    assert list(settings.describe()) == list(CORE_DEFAULTS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_running_requests = 3  # type: ignore[misc]
