"""The KV store path: one Triton launch writes the new tokens' K and V into their pool slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bt, stride_bh, stride_ct, stride_ch,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_k = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = KBuf + slot * stride_bt + offs_h[:, None] * stride_bh + offs_d[None, :]
    dst_v = VBuf + slot * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(dst_k, tl.load(src_k, mask=mask).to(KBuf.dtype.element_ty), mask=mask)
    tl.store(dst_v, tl.load(src_v, mask=mask).to(VBuf.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v: [T, KVH, D] (any row stride, unit stride in D); slots: [T] pool rows to write."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buf, v_buf, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
