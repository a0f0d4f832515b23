"""Triton kernels of the LoRA ``triton`` backend (plugins/models/lora_layers.py): per row,
``y[t, col] += scale[s-1] * (x[t] @ A[s-1]^T) @ B[s-1]^T`` with ``s`` the row's slot (0: the
base model, nothing added), for every sub-projection of a fused module in one launch pair.

Segmented (SGMV style): a program takes a block of ``BLOCK_M`` rows in the step's ``order``
(the rows sorted by slot once per step, so a block holds one or two adapters) and, for each
distinct slot of its block, multiplies a masked ``[BLOCK_M, K] x [K, R]`` tile (shrink) or
``[BLOCK_M, R] x [R, BLOCK_N]`` tile (expand) with ``tl.dot``: an adapter's A and B are read
once per block, not once per row. Any mix of slots in a block is correct (each slot's tile
masks the other rows), sorted or not; the slots and the order are device data and the grid
depends on shapes only, so one captured CUDA graph serves every mix of adapters.

The sub-projections of a fused module (q/k/v, gate/up) share one launch pair: their A are
stacked along R (``a[s, j*R:(j+1)*R]`` is sub ``j``'s), their B along the output columns;
``subs`` names each one's B columns and where they land in ``y``. The shrink splits K over
``split_k`` programs for small batches (decode) and writes partial sums the expand adds up.
Checked on the CPU under TRITON_INTERPRET=1; the GPU timings are bench/experiments/
gpu_kernels.py --lora's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from radixserve.plugins.models import tuned_tiles

# one sub-projection: (first column of b, columns, first column of y it adds to)
Sub = tuple[int, int, int]


@triton.jit
def _block(order_ptr, slots_ptr, T, BLOCK_M: tl.constexpr):
    """The block's positions, their rows and slots, and the range of its adapters' slots."""
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = i < T
    rows = tl.load(order_ptr + i, mask=live, other=0).to(tl.int64)
    s = tl.load(slots_ptr + rows, mask=live, other=0)
    lo = tl.maximum(tl.min(tl.where(s > 0, s, 1 << 30), axis=0), 1)
    # int64: a slot times a pool's stride may pass 2**31
    return i, live, rows, s, lo.to(tl.int64), tl.max(s, axis=0).to(tl.int64)


@triton.jit
def _shrink(x_ptr, a_ptr, slots_ptr, order_ptr, h_ptr, T, K, RT, k_split, stride_x, stride_as,
            stride_ar, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    i, live, rows, s, lo, hi = _block(order_ptr, slots_ptr, T, BLOCK_M)
    split = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for slot in range(lo, hi + 1):
        sel = live & (s == slot)
        if tl.max(sel.to(tl.int32), axis=0) > 0:
            a_base = a_ptr + (slot - 1) * stride_as
            for k0 in range(split * k_split, (split + 1) * k_split, BLOCK_K):
                k = k0 + kk
                x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                            mask=sel[:, None] & (k[None, :] < K), other=0.0)  # fmt: skip
                a = tl.load(a_base + r[None, :] * stride_ar + k[:, None],
                            mask=(r[None, :] < RT) & (k[:, None] < K), other=0.0)  # fmt: skip
                if UPCAST:
                    x, a = x.to(tl.float32), a.to(tl.float32)
                acc += tl.dot(x, a, input_precision=PRECISION)
    dst = h_ptr + (split * T + i.to(tl.int64))[:, None] * RT + r[None, :]
    tl.store(dst, acc, mask=live[:, None] & (r[None, :] < RT))


@triton.jit
def _expand_sub(acc, h_ptr, b_base, c, sel, i, n, T, R, RT, SPLIT_K, stride_bn,
                J: tl.constexpr, ST: tl.constexpr, NC: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_R: tl.constexpr):  # fmt: skip
    """``acc`` plus sub ``J``'s product for the rows ``sel`` (B columns ST..ST+NC)."""
    n0 = tl.program_id(1) * BLOCK_N
    if (n0 < ST + NC) & (n0 + BLOCK_N > ST):
        r = tl.arange(0, BLOCK_R)
        hm = sel[:, None] & (r[None, :] < R)
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for sp in range(0, SPLIT_K):
            src = h_ptr + (sp * T + i.to(tl.int64))[:, None] * RT + J * R + r[None, :]
            h += tl.load(src, mask=hm, other=0.0)
        cols = (n >= ST) & (n < ST + NC)
        b = tl.load(b_base + n[None, :] * stride_bn + r[:, None],
                    mask=cols[None, :] & (r[:, None] < R), other=0.0)  # fmt: skip
        h = (h * c).to(b.dtype)
        if UPCAST:
            h, b = h.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(h, b, input_precision=PRECISION)
    return acc


@triton.jit
def _expand(h_ptr, b_ptr, scale_ptr, slots_ptr, order_ptr, y_ptr, T, R, RT, SPLIT_K, stride_y,
            stride_bs, stride_bn, NSUB: tl.constexpr, ST0: tl.constexpr, NC0: tl.constexpr,
            SH0: tl.constexpr, ST1: tl.constexpr, NC1: tl.constexpr, SH1: tl.constexpr,
            ST2: tl.constexpr, NC2: tl.constexpr, SH2: tl.constexpr, PRECISION: tl.constexpr,
            UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_R: tl.constexpr):  # fmt: skip
    i, live, rows, s, lo, hi = _block(order_ptr, slots_ptr, T, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(lo, hi + 1):
        sel = live & (s == slot)
        if tl.max(sel.to(tl.int32), axis=0) > 0:
            c = tl.load(scale_ptr + slot - 1)
            b_base = b_ptr + (slot - 1) * stride_bs
            acc = _expand_sub(acc, h_ptr, b_base, c, sel, i, n, T, R, RT, SPLIT_K, stride_bn, 0,
                              ST0, NC0, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_R)  # fmt: skip
            if NSUB > 1:
                acc = _expand_sub(acc, h_ptr, b_base, c, sel, i, n, T, R, RT, SPLIT_K,
                                  stride_bn, 1, ST1, NC1, PRECISION, UPCAST, BLOCK_M,
                                  BLOCK_N, BLOCK_R)  # fmt: skip
            if NSUB > 2:
                acc = _expand_sub(acc, h_ptr, b_base, c, sel, i, n, T, R, RT, SPLIT_K,
                                  stride_bn, 2, ST2, NC2, PRECISION, UPCAST, BLOCK_M,
                                  BLOCK_N, BLOCK_R)  # fmt: skip
    # each B column's column of y; columns of no sub (past the last) are not written
    in0 = (n >= ST0) & (n < ST0 + NC0)
    in1 = (n >= ST1) & (n < ST1 + NC1)
    in2 = (n >= ST2) & (n < ST2 + NC2)
    shift = tl.where(in0, SH0 - ST0, 0) + tl.where(in1, SH1 - ST1, 0) + tl.where(in2, SH2 - ST2, 0)
    m = (live & (s > 0))[:, None] & (in0 | in1 | in2)[None, :]
    dst = y_ptr + rows[:, None] * stride_y + (n + shift)[None, :]
    y = tl.load(dst, mask=m, other=0.0)
    tl.store(dst, (y.to(tl.float32) + acc).to(y.dtype), mask=m)


#: the tuned tiles: {device name: {"rows": [BLOCK_M, BLOCK_N, split_k]}}, written on that GPU
#: by bench/experiments/gpu_kernels.py --lora-sweep --write (one layer's four modules timed)
CONFIGS = Path(__file__).with_name("lora_tiles.json")


def default_tiles(t: int, k: int) -> tuple[int, int, int]:
    """Untuned (BLOCK_M, BLOCK_N, split_k) for ``t`` rows of ``k`` features: small batches
    split K so the shrink fills the GPU."""
    block_m = 16 if t <= 128 else 64
    block_n = 64 if t <= 128 else 128
    blocks = triton.cdiv(t, block_m)
    split_k = max(1, min(triton.cdiv(64, blocks), k // 512))
    return block_m, block_n, split_k


def tiles(t: int, k: int, device_name: str | None = None) -> tuple[int, int, int]:
    """The table's tiles for this GPU at the nearest tuned row count, else ``default_tiles``:
    shapes only, so a CUDA graph replays the grid it captured."""
    table = tuned_tiles.entries(CONFIGS, device_name) if device_name else {}
    if not table:
        return default_tiles(t, k)
    block_m, block_n, split_k = tuned_tiles.nearest(table, t)
    return block_m, block_n, split_k


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
    slots: torch.Tensor, order: torch.Tensor, subs: tuple[Sub, ...], split_k: int | None = None,
) -> None:  # fmt: skip
    """In place: each sub-projection's columns of ``y`` gain each row's adapter product.

    x [T, K]; a [S, len(subs) * R, K] (sub j's A at rows j*R..); b [S, N, R] (sub j's B at
    columns ``subs[j][0]``.. for ``subs[j][1]`` columns, added to y's columns from
    ``subs[j][2]``); scale [S] float32; slots [T] int32 (0: the base model); order [T] int32,
    a permutation of the rows (sorted by slot: fewer adapters per block, any order is right).
    """
    t, k = x.shape
    n, r = b.shape[1], b.shape[2]
    if t == 0:
        return
    assert 1 <= len(subs) <= 3 and a.shape[1] == len(subs) * r, (a.shape, b.shape, subs)
    x = x.contiguous()
    block_m, block_n, split = tiles(t, k, tuned_tiles.device_name(x.device))
    split = split_k or split
    block_k = 64
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    rt = a.shape[1]
    # float32 models multiply in full float32 (Triton's default for it would be TF32); the
    # interpreter (a CPU device) multiplies bfloat16 wrongly, so there the tiles go float32 first
    on_cpu = x.device.type == "cpu"
    dots = {"PRECISION": "ieee" if x.dtype == torch.float32 or on_cpu else "tf32", "UPCAST": on_cpu}
    h = torch.empty(split, t, rt, dtype=torch.float32, device=x.device)
    blocks = triton.cdiv(t, block_m)
    _shrink[(blocks, split)](
        x, a, slots, order, h, t, k, rt, k_split, x.stride(0), a.stride(0), a.stride(1),
        **dots, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=max(16, triton.next_power_of_2(rt)),
    )  # fmt: skip
    padded = list(subs) + [(n, 0, 0)] * (3 - len(subs))  # empty subs past the last column
    (st0, nc0, sh0), (st1, nc1, sh1), (st2, nc2, sh2) = padded
    _expand[(blocks, triton.cdiv(n, block_n))](
        h, b, scale, slots, order, y, t, r, rt, split, y.stride(0), b.stride(0), b.stride(1),
        NSUB=len(subs), ST0=st0, NC0=nc0, SH0=sh0, ST1=st1, NC1=nc1, SH1=sh1, ST2=st2,
        NC2=nc2, SH2=sh2, **dots, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(r)),
    )  # fmt: skip
