"""Hardware plugins: cuda / rocm / ascend say why they are unavailable on a CPU machine, are
listed by `radixserve plugins`, outrank the CPU when present, and size the KV pool from
mem_fraction_static; the CUDA-graph batch sizes; the real device (marked ``gpu``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.core.config import EngineConfig
from radixserve.core.plugins import PluginHost
from radixserve.plugins.hardware import cuda as cuda_plugin
from radixserve.plugins.hardware.cuda import CudaPlatform
from radixserve.plugins.hardware.cuda_graph import capture_sizes

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
GIB = 1 << 30


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost(allow=["cpu", "cuda", "rocm", "ascend", "torch_native", "triton"])


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
def test_gpu_platforms_unavailable_on_cpu_with_reasons(host: PluginHost) -> None:
    reasons = {r.name: r.unavailable_reason() for r in host.registries["hardware"].entries()}
    assert reasons["cpu"] is None
    assert reasons["cuda"] in ("this torch has no CUDA support (a CPU build)",
                               "no CUDA device is visible")  # fmt: skip
    assert reasons["rocm"] in ("this torch is not a ROCm build", "no ROCm device is visible")
    if reasons["ascend"] is not None:
        assert "torch_npu" in reasons["ascend"] or "NPU" in reasons["ascend"]
    assert host.select_hardware().name == "cpu"


def test_gpu_platforms_outrank_the_cpu(host: PluginHost) -> None:
    prio = {r.name: r.priority for r in host.registries["hardware"].entries()}
    assert prio["cuda"] > prio["cpu"] and prio["rocm"] > prio["cpu"] and prio["ascend"] > 0


def test_cli_lists_the_hardware_and_attention_plugins() -> None:
    script = Path(sys.executable).parent / "radixserve"
    out = subprocess.run([str(script), "plugins"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {tuple(line.split()[:2]) for line in out.stdout.splitlines()}
    for kind, name in [("hardware", "cuda"), ("hardware", "rocm"), ("hardware", "ascend"),
                       ("attention", "triton")]:  # fmt: skip
        assert (kind, name) in rows, out.stdout


def _bare_cuda_platform() -> CudaPlatform:
    platform = object.__new__(CudaPlatform)  # no torch.cuda.set_device on a CPU machine
    platform.device = "cuda:0"
    return platform


@pytest.mark.parametrize(
    ("free", "fraction", "expected"),
    [
        (140 * GIB, 0.85, int(140 * GIB * 0.85) - 16 * GIB),  # the fraction binds
        (60 * GIB, 0.85, 60 * GIB - 16 * GIB - int(140 * GIB * 0.15)),  # free memory binds
        (140 * GIB, 0.1, 0),  # weights do not fit in the fraction
    ],
)
def test_kv_bytes_from_mem_fraction(
    monkeypatch: pytest.MonkeyPatch, free: int, fraction: float, expected: int
) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 140 * GIB))
    assert _bare_cuda_platform().kv_cache_bytes(16 * GIB, fraction) == expected


def test_defaults_bfloat16_and_triton() -> None:
    platform = _bare_cuda_platform()
    assert platform.default_dtype() == torch.bfloat16
    assert platform.default_plugins()["attention"] == "triton"


def test_disabled_cuda_graph_gives_the_eager_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Attention:
        def prepare(self, batch: object) -> None:
            calls.append("prepare")

        def prepare_decode_graph(self, *args: object) -> None:
            raise AssertionError("no graph capture when disabled")

    class Model:
        def forward(self, batch: object) -> str:
            calls.append("forward")
            return "logits"

    config = EngineConfig(disable_cuda_graph=True)
    step = _bare_cuda_platform().step_executor(Model(), Attention(), None, torch.zeros(1), config)
    assert step(object()) == "logits" and calls == ["prepare", "forward"]  # type: ignore[arg-type]


def test_capture_sizes_cover_every_batch_size() -> None:
    for max_bs in (1, 3, 8, 100, 256, 300):
        sizes = capture_sizes(max_bs)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_bs
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16]


@pytest.mark.gpu
@needs_cuda
def test_cuda_platform_on_a_gpu(host: PluginHost) -> None:
    assert cuda_plugin.cuda_unavailable_reason() is None
    assert host.select_hardware().name == "cuda"
    platform = CudaPlatform()
    assert platform.kv_cache_bytes(GIB, 0.5) > 0
    assert host.registries["attention"].get("triton").unavailable_reason() is None


@pytest.mark.parametrize(
    ("cpu_threads", "omp", "during"),
    [(None, None, 1), (3, None, 3), (None, "2", None), (2, "4", 2)],
)
def test_cuda_engine_runs_one_host_thread_until_released(
    monkeypatch: pytest.MonkeyPatch, cpu_threads: int | None, omp: str | None, during: int | None
) -> None:
    """The engine's host thread count on CUDA: 1 by default, --cpu-threads if given, the
    user's OMP_NUM_THREADS otherwise untouched; shutdown's release gives the process back its
    count (an offline Engine's process goes on)."""
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        platform = _bare_cuda_platform()
        platform.limit_host_threads(cpu_threads)
        assert torch.get_num_threads() == (4 if during is None else during)
        platform.release()
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
