"""The model's fused per-token ops on CPU (the interface of ``plugins/models/fused_ops.py``):
RMSNorm, residual add + RMSNorm, SiLU(gate) * up and RoPE, each one C++ pass
(``cpu_kernels/fused_ops.cpp``) where eager torch runs 2-6 ops with their temporaries.

A float32 decode step of the default model at batch 32 spent ~40 ms of ~330 in those small ops
(profile in bench/HISTORY.md, issue 19). Inputs the kernels do not take (other dtypes) and
steps dynamo traces (``--enable-torch-compile``: inductor fuses the eager code itself) run the
eager formulas, which are the model's own (``plugins/models/eager_ops.py``, the decoder's).
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from radixserve.plugins.hardware import cpu_kernels
from radixserve.plugins.models.eager_ops import rms_norm_eager

_F32 = torch.float32


def _kernel(*tensors: torch.Tensor) -> bool:
    # a loop rather than all(genexpr): this runs ~120 times a SmolLM2 token (~1 us less each)
    for t in tensors:
        if t.dtype is not _F32:
            return False
    return not torch.compiler.is_compiling()


@cache
def _ops() -> Any:
    """The fused ops' overloads: called directly, a few us less a call than through
    ``torch.ops``' packets, ~120 calls a SmolLM2 token."""
    ops = cpu_kernels.load()
    return SimpleNamespace(
        rms_norm=ops.rms_norm.default,
        add_rms_norm=ops.add_rms_norm.default,
        silu_mul=ops.silu_mul.default,
        rope=ops.rope.default,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _kernel(x, weight) or x.dim() != 2:
        return rms_norm_eager(x, weight, eps)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    return _ops().rms_norm(x2, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if not _kernel(x, residual, weight) or x.dim() != 2 or x.shape != residual.shape:
        total = x + residual
        return rms_norm_eager(total, weight, eps), total
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    r2 = residual if residual.stride(-1) == 1 else residual.contiguous()
    return _ops().add_rms_norm(x2, r2, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * N] = [gate | up] -> SiLU(gate) * up, [T, N]."""
    if not _kernel(x) or x.dim() != 2:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _ops().silu_mul(x if x.stride(-1) == 1 else x.contiguous())


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D] into a new contiguous tensor; cos, sin:
    [max_positions, D / 2] tables."""
    if not _kernel(x, cos, sin):
        half = x.shape[-1] // 2
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    return _ops().rope(x2, positions.to(torch.int64).contiguous(), cos, sin)
