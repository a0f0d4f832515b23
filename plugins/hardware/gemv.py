"""A Triton matrix-vector product for one-token decode steps, with SiLU(gate) * up fused into
its input for an MLP's down projection (issue 17; the decoder skeleton uses it on CUDA unless
RADIXSERVE_TRITON_GEMV=0).

At one token a decoder's products are matrix-vector products bound by reading the weights;
cuBLAS reads large ones near the copy bandwidth but loses a fixed few microseconds on each, a
larger share of the half-width matrices of tensor parallelism, and splits some of them over K
with a second reduce kernel. This kernel splits the output rows over the programs, each
reading its rows' weights in BLOCK_K-wide strips with float32 sums; fusing the activation into
the down projection also drops one kernel per layer. H200, 8B shape, batch-1 decode: TP1 210.5
-> 219.5 tok/s, TP2 298.4 -> 327.9 (317.1 without the SiLU fusion); bench/HISTORY.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(X, W, Y, N, K, stride_w, SILU: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = Y.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        if SILU:  # X = [gate | up]: the input is SiLU(gate) * up, rounded as silu_mul does
            gate = tl.load(X + cols).to(tl.float32)
            up = tl.load(X + K + cols).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            x = (act * up).to(dtype).to(tl.float32)
        else:
            x = tl.load(X + cols).to(tl.float32)
        w = tl.load(W + rows[:, None].to(tl.int64) * stride_w + cols[None, :])
        acc += w.to(tl.float32) * x[None, :]
    tl.store(Y + rows, tl.sum(acc, 1).to(dtype))


Config = tuple[int, int, int]  # (BLOCK_N, BLOCK_K, warps); (0, 0, 0): by shape (``pick``)
AUTO: Config = (0, 0, 0)


def config() -> Config | None:
    """RADIXSERVE_TRITON_GEMV: "0" off, "1" or "auto" (the default) a configuration per shape
    (``pick``), "n,k,warps" one for every shape."""
    spec = os.environ.get("RADIXSERVE_TRITON_GEMV", "auto")
    if spec == "0":
        return None
    if spec in ("1", "auto"):
        return AUTO
    n, k, warps = (int(v) for v in spec.split(","))
    return n, k, warps


def fuse_silu() -> bool:
    """Whether the down projection takes SiLU(gate) * up inside (RADIXSERVE_TRITON_GEMV_SILU,
    default on)."""
    return os.environ.get("RADIXSERVE_TRITON_GEMV_SILU", "1") != "0"


def pick(n: int, k: int) -> Config:
    """H200, bfloat16 (bench/tp_micro.py, 32 distinct weights of a shape back to back): 4 rows
    a program in 1,024-wide strips for the attention and down projections (3,072-4,096 rows),
    16 rows in 256-wide strips for the tall gate_up (14,336 rows)."""
    if n >= 8192:
        return (16, 256, 4)
    for bk in (1024, 512, 256):
        if k % bk == 0:
            return (4, bk, 4)
    return (4, 1024, 4)  # not taken: K is no multiple of a strip


def takes(x: torch.Tensor, weight: torch.Tensor, cfg: Config, silu: bool) -> bool:
    """Whether the kernel takes this product: one row, whole blocks, unit strides."""
    n, k = weight.shape
    if cfg == AUTO:
        cfg = pick(n, k)
    width = 2 * k if silu else k
    return (
        x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == width and x.stride(-1) == 1
        and weight.stride(-1) == 1 and n % cfg[0] == 0 and k % cfg[1] == 0
        and x.dtype == weight.dtype
    )  # fmt: skip


def gemv(x: torch.Tensor, weight: torch.Tensor, cfg: Config, silu: bool = False) -> torch.Tensor:
    """x [1, K] (or [1, 2K] = [gate | up] with ``silu``) @ weight[N, K].T -> [1, N]."""
    n, k = weight.shape
    if cfg == AUTO:
        cfg = pick(n, k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    bn, bk, warps = cfg
    _gemv_kernel[(n // bn,)](
        x, weight, y, n, k, weight.stride(0), SILU=silu, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps
    )
    return y
