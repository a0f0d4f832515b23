"""The eager torch formulas of the model's small per-token ops, whose rounding the fused kernels
follow (``plugins/models/fused_ops.py`` on CUDA/ROCm, ``plugins/hardware/cpu_fused_ops.py`` on the
CPU, which falls back to them for inputs its kernels do not take).

A module of its own so that the models and the hardware plugins both import it and neither
imports the other's modules at load (``tests/core/test_import_graph.py`` keeps it so).
"""

from __future__ import annotations

import torch


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in eager torch: normalized in float32, rounded to x's dtype, times ``weight``."""
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
