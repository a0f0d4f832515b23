"""--enable-torch-compile on the CPU: compiled decode steps give the eager steps' tokens on
traffic that reuses KV (identical and repeated prompts, a pool small enough to retract), a
failing compiled step falls back to eager without failing its requests, and a platform without
compiled steps refuses the flag."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from small_pool_speculation import small_pool_engine, traffic

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.plugins.hardware.cpu_compile import CompiledDecode, compile_sizes


def _run(model: Path, **kw: Any) -> tuple[list[list[int]], int, Any]:
    """(output ids, retractions, the step executor) of the shared small-pool traffic."""
    prompts, params = traffic()
    with small_pool_engine(model, **kw) as engine:
        out = engine.generate(input_ids=prompts, sampling_params=params)
        engine.core.scheduler.check_no_leak()
        lone = engine.generate(input_ids=prompts[0], sampling_params=params)  # a batch of one
        ids = [o["output_ids"] for o in out] + [lone["output_ids"]]
        return ids, engine.core.scheduler.stats.retractions, engine.core.runner.step


@pytest.fixture(scope="module")
def eager(tiny_llama_dir: Path) -> list[list[int]]:
    return _run(tiny_llama_dir)[0]


# On a CUDA machine the engines take the cuda platform, which refuses the flag (last test); forced
# onto the CPU there, inductor's CPU compile of the device image's torch broke the process.
cpu_engines = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU serving: the cuda platform replays CUDA graphs instead"
)


@cpu_engines
def test_compiled_decode_equals_eager_under_reuse_and_retraction(
    tiny_llama_dir: Path, eager: list[list[int]]
) -> None:
    outputs, retractions, executor = _run(
        tiny_llama_dir, enable_torch_compile=True, torch_compile_max_bs=4
    )
    assert isinstance(executor, CompiledDecode)
    assert executor.sizes == [1, 2, 4]
    assert retractions > 0, "the pool must force retractions"
    assert executor.compiled_steps > 0 and not executor.failed
    assert outputs == eager


@cpu_engines
def test_a_failing_compiled_step_runs_eagerly(
    tiny_llama_dir: Path, eager: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real_init = CompiledDecode.__init__

    def init(self: CompiledDecode, *args: Any) -> None:
        real_init(self, *args)

        def broken(batch: Any) -> torch.Tensor:
            calls["n"] += 1
            raise RuntimeError("simulated recompile limit")

        self.compiled = broken  # after the warm-up: the first served step fails

    monkeypatch.setattr(CompiledDecode, "__init__", init)
    outputs, _, executor = _run(tiny_llama_dir, enable_torch_compile=True, torch_compile_max_bs=1)
    assert calls["n"] == 1  # tried once, then every step eager
    assert executor.failed and executor.compiled_steps == 0
    assert outputs == eager  # nothing failed or changed


def test_compile_sizes() -> None:
    assert compile_sizes(1) == [1]
    assert compile_sizes(6) == [1, 2, 4, 6]
    assert compile_sizes(8) == [1, 2, 4, 8]


def test_the_flag_is_checked() -> None:
    with pytest.raises(ConfigError, match="torch_compile_max_bs"):
        EngineConfig(torch_compile_max_bs=0)


def test_a_platform_without_compiled_steps_refuses_the_flag(tiny_llama_dir: Path) -> None:
    from radixserve.core.interfaces import HardwarePlatform

    class Plain(HardwarePlatform):
        name, device = "plain", "cpu"

        def default_dtype(self) -> torch.dtype:
            return torch.float32

        def default_plugins(self) -> dict[str, str]:
            return {}

        def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:
            return 0

    config = EngineConfig(enable_torch_compile=True)
    with pytest.raises(ConfigError, match="--enable-torch-compile is not supported on the plain"):
        Plain().step_executor(None, None, None, None, config)  # type: ignore[arg-type]
