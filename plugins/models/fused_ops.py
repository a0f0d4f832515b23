"""Triton versions of the Llama family's small per-token ops, for CUDA/ROCm devices: RMSNorm (also
fused with the residual add before it), rotary embedding, and SiLU(gate) * up.

Each replaces several eager kernels with one (a decode step runs thousands of them, so their
fixed cost adds up even inside a CUDA graph). Rounding follows the eager code: RMSNorm normalizes
in float32, rounds, then multiplies by the weight; SiLU rounds before the product. Imported only
when the model runs on such a device (``llama.fused_ops_for``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, W, Out, stride_x, stride_o, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    normed = (x * rstd).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * normed).to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] with unit stride in N."""
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x2)
    n = x2.shape[-1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight, out, x2.stride(0), out.stride(0), n, eps,
        BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return out


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Out, Total, stride_x, stride_r, stride_o, stride_t, N, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    total = (x + r).to(dtype)  # the stream is rounded before it is normalized, as eagerly
    tl.store(Total + row * stride_t + offs, total, mask=mask)
    t = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(t * t, 0) / N + eps)
    normed = (t * rstd).to(dtype).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * normed).to(dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; x, residual: [T, N]."""
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    r2 = residual if residual.stride(-1) == 1 else residual.contiguous()
    out, total = torch.empty_like(x2), torch.empty_like(x2)
    n = x2.shape[-1]
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, total, x2.stride(0), r2.stride(0), out.stride(0), total.stride(0),
        n, eps, BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return out, total


@triton.jit
def _rope_kernel(
    X, Out, Positions, Cos, Sin,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cos,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h < HEADS)[:, None] & mask_d[None, :]
    cos = tl.load(Cos + pos * stride_cos + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(Sin + pos * stride_cos + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    src = X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    dtype = Out.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D] (any token/head strides) into a new contiguous
    tensor; cos, sin: [max_positions, D / 2] tables."""
    t, heads, dim = x.shape
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    half = dim // 2
    _rope_kernel[(t,)](
        x, out, positions, cos, sin,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
        HEADS=heads, BLOCK_H=triton.next_power_of_2(heads),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
    )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * up).to(dtype), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * N] = [gate | up] -> SiLU(gate) * up, [T, N]."""
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    t, n = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(n, block))](
        x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
    )
    return out
