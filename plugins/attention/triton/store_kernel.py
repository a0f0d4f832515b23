"""The KV store path: one Triton launch writes the new tokens' K and V into their pool slots
(optionally rotating q and k by RoPE on the way: the model's own RoPE launch is then saved)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.plugins.models.fp8_kernels import round_e4m3_exact

# float8_e4m3fn's largest value; a constexpr object, since kernels may read only those globals
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Slots, stride_s,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bt, stride_bh, stride_ct, stride_ch, inv_k_scale, inv_v_scale,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE: tl.constexpr,
    EXACT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(Slots + t * stride_s).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_k = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = KBuf + slot * stride_bt + offs_h[:, None] * stride_bh + offs_d[None, :]
    dst_v = VBuf + slot * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if SATURATE:
        k = _narrowed(k, inv_k_scale, EXACT)
        v = _narrowed(v, inv_v_scale, EXACT)
    tl.store(dst_k, k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(VBuf.dtype.element_ty), mask=mask)


@triton.jit
def _narrowed(x, inv_scale, EXACT: tl.constexpr):
    """x / scale clamped to FP8 e4m3's range (a plain cast makes NaN of what overflows).
    EXACT (the interpreter): rounded to e4m3's values here, since the interpreter's own cast
    mis-rounds where the rounding carries into the exponent and below 2^-6."""
    y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    if EXACT:
        y = round_e4m3_exact(y)
    return y


def _store_scales(buf: torch.Tensor, scale: float) -> tuple[float, bool]:
    """(the multiplier a store applies, whether it saturates): FP8 buffers only."""
    fp8 = buf.dtype.itemsize == 1
    return (1.0 / scale if fp8 else 1.0), fp8


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:  # fmt: skip
    """k, v: [T, KVH, D] (any row stride, unit stride in D); slots: [T] pool rows to write (any
    stride: a view of a staged buffer, as the EAGLE proposal graph passes at batch 1). An FP8
    pool stores k / k_scale and v / v_scale, clamped to its range."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    inv_k, saturate = _store_scales(k_buf, k_scale)
    inv_v, _ = _store_scales(v_buf, v_scale)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buf, v_buf, slots, slots.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), inv_k, inv_v,
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), SATURATE=saturate,
        EXACT=k.device.type == "cpu",
    )  # fmt: skip


@triton.jit
def _rotate_half(
    src,
    dst,
    cos,
    sin,
    mask,
    HALF: tl.constexpr,
    inv_scale,
    SATURATE: tl.constexpr,
    EXACT: tl.constexpr,
):
    """dst = RoPE(src) for a [heads, HALF] block pair, in float32, rounded to dst's dtype
    (with SATURATE, divided by the FP8 cache's scale and clamped to its range first)."""
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = dst.dtype.element_ty
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    if SATURATE:
        y1 = _narrowed(y1, inv_scale, EXACT)
        y2 = _narrowed(y2, inv_scale, EXACT)
    tl.store(dst, y1.to(dtype), mask=mask)
    tl.store(dst + HALF, y2.to(dtype), mask=mask)


@triton.jit
def _store_kv_rotary_kernel(
    Q, K, V, QOut, KBuf, VBuf, Slots, Positions, Cos, Sin, stride_s, stride_p,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_bt, stride_bh, stride_ct, stride_ch, stride_cos, inv_k_scale, inv_v_scale,
    NUM_HEADS: tl.constexpr, BLOCK_Q: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    SATURATE: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(Slots + t * stride_s).to(tl.int64)
    pos = tl.load(Positions + t * stride_p).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    cos = tl.load(Cos + pos * stride_cos + offs_half, mask=mask_half, other=0.0).to(tl.float32)
    sin = tl.load(Sin + pos * stride_cos + offs_half, mask=mask_half, other=0.0).to(tl.float32)
    offs_q = tl.arange(0, BLOCK_Q)
    mask_q = (offs_q < NUM_HEADS)[:, None] & mask_half[None, :]
    _rotate_half(
        Q + t * stride_qt + offs_q[:, None] * stride_qh + offs_half[None, :],
        QOut + t * stride_ot + offs_q[:, None] * stride_oh + offs_half[None, :],
        cos, sin, mask_q, HALF, 1.0, False, False,
    )  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    mask_k = (offs_h < NUM_KV_HEADS)[:, None] & mask_half[None, :]
    _rotate_half(
        K + t * stride_kt + offs_h[:, None] * stride_kh + offs_half[None, :],
        KBuf + slot * stride_bt + offs_h[:, None] * stride_bh + offs_half[None, :],
        cos, sin, mask_k, HALF, inv_k_scale, SATURATE, EXACT,
    )  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    mask_v = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_v = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_v = VBuf + slot * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    v = tl.load(src_v, mask=mask_v)
    if SATURATE:
        v = _narrowed(v, inv_v_scale, EXACT)
    tl.store(dst_v, v.to(VBuf.dtype.element_ty), mask=mask_v)


def store_kv_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """``store_kv`` with rotate-half RoPE applied on the way, in the same launch: K is rotated
    into its slots and the rotated q [T, H, D] is returned (a new contiguous tensor), with the
    rounding of the model's own RoPE kernel. q, k, v: [T, heads, D] (any token and head
    strides, unit stride in D); cos, sin: [max_positions, D / 2] tables; slots, positions: [T]
    (any stride)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    inv_k, saturate = _store_scales(k_buf, k_scale)
    inv_v, _ = _store_scales(v_buf, v_scale)
    _store_kv_rotary_kernel[(num_tokens,)](
        q, k, v, q_out, k_buf, v_buf, slots, positions, cos, sin,
        slots.stride(0), positions.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), cos.stride(0),
        inv_k, inv_v,
        NUM_HEADS=num_heads, BLOCK_Q=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), SATURATE=saturate,
        EXACT=q.device.type == "cpu",
    )  # fmt: skip
    return q_out
