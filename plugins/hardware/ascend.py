"""The ``ascend`` hardware platform (Huawei NPUs through ``torch_npu``).

Untested on hardware here. ``torch_npu`` adds the ``npu`` device and ``torch.npu``; attention
uses the torch_native reference backend (the Triton kernels target CUDA/ROCm).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import HardwarePlatform
from radixserve.plugins.hardware.cpu import CpuPlatform


def _npu() -> Any:
    importlib.import_module("torch_npu")  # registers torch.npu
    return torch.npu  # type: ignore[attr-defined]


class AscendPlatform(HardwarePlatform):
    name = "ascend"

    def __init__(self, index: int = 0) -> None:
        self.device = f"npu:{index}"
        _npu().set_device(index)

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def default_plugins(self) -> dict[str, str]:
        return CpuPlatform().default_plugins()  # torch_native attention: no Triton on NPUs

    def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:
        free, total = _npu().mem_get_info()
        budget = int(total * mem_fraction) - weight_bytes
        return max(min(budget, free - weight_bytes - int(total * (1 - mem_fraction))), 0)

    def synchronize(self) -> None:
        _npu().synchronize()

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)
        _npu().manual_seed_all(seed)

    def empty_cache(self) -> None:
        _npu().empty_cache()


def ascend_unavailable_reason() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "the 'torch_npu' package is not installed"
    if not _npu().is_available():
        return "no Ascend NPU is visible"
    return None


@hookimpl
def register_hardware_platforms(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "ascend",
        AscendPlatform,
        available=ascend_unavailable_reason,
        description="Huawei Ascend NPU via torch_npu (bfloat16)",
        priority=90,
    )
