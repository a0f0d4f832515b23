"""The Triton kernel of block-scaled FP8 products (``fp8.block_fp8_matmul``): FP8 activations
with a scale per token and 128 inputs times FP8 weights with a scale per 128 x 128 tile.

Each program computes a BLOCK_M x BLOCK_N tile of the output. BLOCK_K is the scales' group of
inputs (128), so each K step's partial product ``dot(a, b)`` (FP8 x FP8 on the tensor cores,
float32 sums) takes one activation scale per row and one weight scale per column before it is
added to the accumulator. Imported only where Triton runs (a GPU, or TRITON_INTERPRET=1).
"""

from __future__ import annotations

import triton
import triton.language as tl


def tiles_for(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for M rows: narrow output tiles for decode-sized steps, so a step of
    a few rows still spreads the weight reads over many programs (N / 32 of them), wider ones
    once the rows make the product compute-bound."""
    if m <= 16:
        return 16, 32
    if m <= 64:
        return 32, 64
    return 64, 128


@triton.jit
def block_fp8_gemm(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
    GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c[M, N] = sum over K slices of (a_slice @ b_slice.T) * a_scale[m, slice] *
    b_scale[n // GROUP_N, slice]; a [M, K] and b [N, K] FP8, row-major."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < left), other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < left), other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def round_e4m3_exact(y):
    """y (float32, within +-448) rounded to FP8 e4m3's values, ties to even: for Triton's
    interpreter, whose own cast mis-rounds where the rounding carries into the exponent and
    below 2^-6 (a GPU's cast is exact)."""
    bits = y.to(tl.int32, bitcast=True)  # normal range: 3 mantissa bits, ties to even
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    t = tl.abs(y) * 512.0  # subnormals: multiples of 2^-9
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r % 2 != 0), r - 1.0, r)
    r = tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r) / 512.0  # -0.0 too
    return tl.where(tl.abs(y) < 0.015625, r, bits.to(tl.float32, bitcast=True))


@triton.jit
def _e4m3(y, EXACT: tl.constexpr):
    """y (float32, within +-448) as FP8 e4m3 codes (EXACT: under the interpreter)."""
    if EXACT:
        y = round_e4m3_exact(y)
    return y.to(tl.float8e4nv)


@triton.jit
def quantize_groups_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """One program per row and group of GROUP inputs (GROUP = K: one scale per row): the
    group's largest magnitude / 448 as its scale, the values divided by it as FP8 codes. Two
    passes over the group (its max, then the codes) of BLOCK values each."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * GROUP
    offs = tl.arange(0, BLOCK)
    top = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, GROUP, BLOCK):
        cols = start + k0 + offs
        ok = (cols < K) & (k0 + offs < GROUP)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(x))
    scale = tl.maximum(tl.max(top, 0) / 448.0, 1e-12)
    tl.store(s_ptr + row * stride_sm + g, scale)
    for k0 in range(0, GROUP, BLOCK):
        cols = start + k0 + offs
        ok = (cols < K) & (k0 + offs < GROUP)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + row * stride_qm + cols, _e4m3(y, EXACT), mask=ok)


@triton.jit
def fp8_gemv_kernel(
    X, W, S, Y, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """Y[0, n] = scale[n] * sum_k W[n, k] * X[0, k]: one-row steps (batch-1 decode) read the FP8
    codes and widen them, with X as it is (no activation rounding); the shape of
    plugins/hardware/gemv.py's kernel, each program BLOCK_N rows in BLOCK_K-wide strips."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        x = tl.load(X + cols).to(tl.float32)
        w = tl.load(W + rows[:, None].to(tl.int64) * stride_w + cols[None, :])
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1) * tl.load(S + rows)
    tl.store(Y + rows, out.to(Y.dtype.element_ty))
