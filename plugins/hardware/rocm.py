"""The ``rocm`` hardware platform (AMD GPUs through torch's HIP build, same ``torch.cuda`` API).

Untested on hardware here: it reuses the CUDA platform, whose kernels are Triton and whose graph
capture torch maps to HIP graphs.
"""

from __future__ import annotations

import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.plugins.hardware.cuda import CudaPlatform


class RocmPlatform(CudaPlatform):
    name = "rocm"


def rocm_unavailable_reason() -> str | None:
    if not torch.version.hip:
        return "this torch is not a ROCm build"
    if not torch.cuda.is_available():
        return "no ROCm device is visible"
    return None


@hookimpl
def register_hardware_platforms(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "rocm",
        RocmPlatform,
        available=rocm_unavailable_reason,
        description="AMD GPU via ROCm (bfloat16, Triton attention)",
        priority=100,
    )
