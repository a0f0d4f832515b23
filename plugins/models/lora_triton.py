"""Triton kernels of the LoRA ``triton`` backend (plugins/models/lora_layers.py): per token,
``y[t, off:off+N] += scale[s-1] * (x[t] @ A[s-1]^T) @ B[s-1]^T`` with ``s`` its slot (0: the
base model, nothing added). Two launches per sub-projection: shrink (x -> rank) and expand
(rank -> output columns), one program per token (and output block), the slot read from a
device tensor, so any mix of adapters runs in one captured CUDA graph. Checked on the CPU
under TRITON_INTERPRET=1; not yet measured on a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink(x_ptr, a_ptr, slots_ptr, out_ptr, K, R, stride_x, stride_as, stride_ar,
            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if s > 0:
        a_row = a_ptr + (s - 1).to(tl.int64) * stride_as
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k < K, other=0.0)
            a = tl.load(a_row + r[:, None] * stride_ar + k[None, :],
                        mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)  # fmt: skip
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * R + r, acc, mask=r < R)


@triton.jit
def _expand(h_ptr, b_ptr, scale_ptr, slots_ptr, y_ptr, N, R, offset, stride_y, stride_bs,
            stride_bn, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    if s > 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + t.to(tl.int64) * R + r, mask=r < R, other=0.0)
        b = tl.load(b_ptr + (s - 1).to(tl.int64) * stride_bs + n[:, None] * stride_bn + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)  # fmt: skip
        d = tl.sum(b.to(tl.float32) * h[None, :], axis=1) * tl.load(scale_ptr + s - 1)
        dst = y_ptr + t.to(tl.int64) * stride_y + offset + n
        y = tl.load(dst, mask=n < N, other=0.0)
        tl.store(dst, (y.to(tl.float32) + d).to(y.dtype), mask=n < N)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
    slots: torch.Tensor, offset: int,
) -> None:  # fmt: skip
    """In place: ``y[:, offset:offset + b.shape[1]]`` gains each token's adapter product.
    x [T, K], a [S, R, K], b [S, N, R], scale [S] float32, slots [T] int32 (0: none)."""
    t, k = x.shape
    _, n, r = b.shape
    if t == 0:
        return
    x = x.contiguous()
    h = torch.empty(t, r, dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(r)
    _shrink[(t,)](x, a, slots, h, k, r, x.stride(0), a.stride(0), a.stride(1),
                  BLOCK_R=block_r, BLOCK_K=64)  # fmt: skip
    block_n = 64
    _expand[(t, triton.cdiv(n, block_n))](
        h,
        b,
        scale,
        slots,
        y,
        n,
        r,
        offset,
        y.stride(0),
        b.stride(0),
        b.stride(1),
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )
