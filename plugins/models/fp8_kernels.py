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
