"""Which kernels a model built on a device runs, decided once at build time: the fused ops
module for RMSNorm, RoPE and SiLU-mul (Triton on CUDA/ROCm, C++ on the CPU, else eager torch),
the Triton GEMV for one-row steps, and whether RoPE runs inside the attention backend's K/V
store; and the build-time check that the attention backend takes the per-layer keywords a
model needs.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from types import ModuleType
from typing import Any

import torch
from torch import nn

from radixserve.core.config import ConfigError
from radixserve.core.interfaces import AttentionBackend


def check_attention_options(attention: AttentionBackend, options: list[dict[str, Any]]) -> None:
    """Stop at build time, naming the backend, when it lacks a per-layer keyword the model
    needs (e.g. a third-party backend without ``sliding_window``)."""
    needed = {key for layer in options for key in layer}
    if not needed:
        return
    params = inspect.signature(attention.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = sorted(needed - set(params))
    if missing:
        raise ConfigError(
            f"attention backend {type(attention).__name__} does not support "
            f"{', '.join(missing)}, which this model needs; use --plugin attention=torch_native "
            "or attention=triton"
        )


def takes_rotary(attention: AttentionBackend, fused_rope: bool) -> bool:
    """Whether q and k go to ``attention`` unrotated, for its K/V store to apply RoPE in the
    same launch (one launch a layer less): where its ``forward`` takes ``rotary`` and the model
    would otherwise run the Triton RoPE kernel (RADIXSERVE_ROPE_IN_ATTENTION: "0" never, "1"
    wherever the backend takes it, as on the CPU's interpreted kernels in tests)."""
    mode = os.environ.get("RADIXSERVE_ROPE_IN_ATTENTION", "auto")
    if mode == "0" or "rotary" not in inspect.signature(attention.forward).parameters:
        return False
    return fused_rope or mode == "1"


def triton_gemv_config(device: str) -> tuple[int, int, int] | None:
    """plugins/hardware/gemv.py's configuration on an NVIDIA GPU with Triton (measured on H200
    only; not on ROCm), unless RADIXSERVE_TRITON_GEMV=0; else None."""
    if torch.device(device).type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    if torch.version.hip is not None:
        return None
    from radixserve.plugins.hardware.gemv import config

    return config()


def attach_fused_ops(module: nn.Module, fused: ModuleType | None) -> None:
    """Point every part of ``module`` that can run on fused kernels (its RMSNorms and MLPs,
    and its ``rope`` table, which is no submodule) at the ops module ``fused``."""
    for part in (getattr(module, "rope", None), *module.modules()):
        if part is not None and hasattr(part, "fused"):
            part.fused = fused


def fused_ops_for(device: str) -> ModuleType | None:
    """The Triton ops module on a CUDA/ROCm device with Triton installed; on the CPU the C++
    ops of ``plugins/hardware/cpu_fused_ops.py`` where they can be built (and
    RADIXSERVE_CPU_FUSED_OPS is not "0"); else None (eager torch)."""
    kind = torch.device(device).type
    if kind == "cpu":
        from radixserve.plugins.hardware.cpu_kernels import unavailable_reason

        if os.environ.get("RADIXSERVE_CPU_FUSED_OPS") == "0" or unavailable_reason() is not None:
            return None
        from radixserve.plugins.hardware import cpu_fused_ops

        return cpu_fused_ops
    if kind != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from radixserve.plugins.models import fused_ops

    return fused_ops
