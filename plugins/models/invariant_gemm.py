"""A batch-invariant GEMM in Triton for --enable-deterministic-inference on CUDA (opt-in:
``RADIXSERVE_INVARIANT_GEMM=triton``, wired in by invariant_ops.py).

``invariant_linear(x, weight, bias)`` is ``F.linear`` (x [M, K], weight [N, K] as nn.Linear
stores it, float32 sums, the output in x's dtype) whose every output element is reduced over
K in one fixed order whatever M is, so a row's result depends only on the row and the weight:

- The tiles (``GemmTiles``: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, group size, the split of
  K) come from ``tiles_for(n, k, dtype)``, which does not take M. A row is one row of a
  BLOCK_M x BLOCK_N tile whatever its neighbours; rows past M are masked loads of zeros, which
  a dot product never mixes into the other rows. The kernel is compiled without specializing
  on M (``do_not_specialize``): one binary for every batch.
- K is cut into ``splits`` fixed chunks of whole BLOCK_K steps (more than one only for shapes
  with few N tiles, so that a decode step still spreads the weight reads over enough
  programs). Each chunk is summed from zero in K order, and the chunks are added in order,
  from zero, in float32; the bias comes last. No atomics (their order is not fixed).
- Where those chunk sums are added is a launch choice, not arithmetic: when the output has
  few tiles (decode), each (tile, chunk) is its own program and writes its float32 partial to
  a workspace that a second kernel adds up; otherwise one program a tile adds its chunks in
  registers. Both run the same additions on the same values, so they give the same bits
  (tests/plugins/models/test_invariant_gemm.py checks it).

Launch order is grouped (``group_m`` M tiles share a band of N tiles), so a wave of programs
reads each weight tile from L2 rather than DRAM; the weights are read once per such wave, not
once per row block as in the fixed-row-block products. Imported only where Triton runs (a GPU,
or TRITON_INTERPRET=1 on the CPU in the tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: programs a launch should give the GPU at least (an H100 / H200 has 132 SMs): shapes with
#: fewer N tiles split K, and a step with fewer output tiles sums its splits in a workspace
FILL_PROGRAMS = 128
MAX_SPLITS = 8
#: K steps a split keeps at least (shorter ones pay more for the partials than they gain)
MIN_STEPS_PER_SPLIT = 8


@dataclass(frozen=True)
class GemmTiles:
    """One launch configuration; a function of (N, K, dtype) only (``tiles_for``)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    splits: int


@functools.cache
def tiles_for(n: int, k: int, dtype: torch.dtype) -> GemmTiles:
    """The tiles for an [N, K] weight in ``dtype``. NOTE: M is deliberately not an argument:
    a row's arithmetic must not change with the batch it comes in."""
    if dtype == torch.float32:
        block_m, block_n, block_k, warps, stages = 64, 64, 32, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    n_tiles, k_steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    splits = 1
    while (
        n_tiles * splits < FILL_PROGRAMS
        and splits < MAX_SPLITS
        and k_steps >= 2 * splits * MIN_STEPS_PER_SPLIT
    ):
        splits *= 2
    return GemmTiles(block_m, block_n, block_k, 8, warps, stages, splits)


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s (M tile, N tile), ``GROUP_M`` M tiles down each band of N tiles."""
    m_tiles = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(m_tiles - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows_in_group, (pid % per_group) // rows_in_group


@triton.jit
def _chunk(x_ptr, w_ptr, rows, cols, M, N, K, k_start, k_len, stride_xm, stride_xk,
           stride_wn, stride_wk, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The [BLOCK_M, BLOCK_N] float32 sum over K in [k_start, k_start + k_len), from zero, in
    K order (masked: rows past M, columns past N and K past K read zeros)."""
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_len, BLOCK_K):
        k = k0 + kk
        a = tl.load(x_rows + k[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)  # fmt: skip
        b = tl.load(w_cols + k[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)  # fmt: skip
        if UPCAST:  # the interpreter's dot of 16-bit floats is wrong; their products are exact
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M", "stride_os"])
def _gemm(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_len, stride_xm, stride_xk, stride_wn,
          stride_wk, stride_om, stride_os, SPLITS: tl.constexpr, IN_REGISTERS: tl.constexpr,
          HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
          BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    """IN_REGISTERS: out[M, N] = bias + the SPLITS chunk sums added in order. Else program
    (tile, s) writes chunk s's float32 sum to out[s] (a [SPLITS, M, N] workspace)."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if IN_REGISTERS:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            total += _chunk(x_ptr, w_ptr, rows, cols, M, N, K, s * k_len, k_len, stride_xm,
                            stride_xk, stride_wn, stride_wk, PRECISION, UPCAST, BLOCK_M,
                            BLOCK_N, BLOCK_K)  # fmt: skip
        if HAS_BIAS:
            total += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(dst, total.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        s = tl.program_id(1)
        part = _chunk(x_ptr, w_ptr, rows, cols, M, N, K, s * k_len, k_len, stride_xm,
                      stride_xk, stride_wn, stride_wk, PRECISION, UPCAST, BLOCK_M,
                      BLOCK_N, BLOCK_K)  # fmt: skip
        tl.store(dst + s.to(tl.int64) * stride_os, part, mask=inside)


@triton.jit(do_not_specialize=["M", "stride_os"])
def _sum_splits(ws_ptr, b_ptr, out_ptr, M, N, stride_os, SPLITS: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """out = bias + the workspace's SPLITS partials added in order, from zero (as _gemm's
    IN_REGISTERS branch adds them), over a flat block of the [M, N] output."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        total += tl.load(ws_ptr + s * stride_os + i, mask=inside, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + i % N, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, total.to(out_ptr.dtype.element_ty), mask=inside)


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiles: GemmTiles | None = None,
    workspace: bool | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (x [..., K]) with a row's bits independent of the batch.
    ``tiles`` overrides ``tiles_for`` (tests, tuning); ``workspace`` forces where the K
    splits are added (None: a workspace when the output has fewer than FILL_PROGRAMS tiles),
    which changes the speed, never the result."""
    if x.dtype != weight.dtype:
        raise ValueError(f"invariant_linear: x is {x.dtype} but the weight {weight.dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    t = tiles or tiles_for(n, k, weight.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    output_tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    if workspace is None:
        workspace = t.splits > 1 and output_tiles < FILL_PROGRAMS
    splits_launched = t.splits if workspace else 1
    target = torch.empty(t.splits, m, n, dtype=torch.float32, device=x.device) if workspace else out
    k_len = triton.cdiv(triton.cdiv(k, t.block_k), t.splits) * t.block_k
    on_cpu = x.device.type == "cpu"  # TRITON_INTERPRET=1
    # float32 sums of exact float32 products; 16-bit inputs ignore the setting on a GPU
    precision = "ieee" if x.dtype == torch.float32 or on_cpu else "tf32"
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    _gemm[(output_tiles, splits_launched)](
        x2, weight, bias_arg, target, m, n, k, k_len, x2.stride(0), x2.stride(1),
        weight.stride(0), weight.stride(1), n, m * n, SPLITS=t.splits,
        IN_REGISTERS=not workspace, HAS_BIAS=bias is not None, PRECISION=precision,
        UPCAST=on_cpu, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if workspace:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](
            target, bias_arg, out, m, n, m * n, SPLITS=t.splits, HAS_BIAS=bias is not None,
            BLOCK=block,
        )  # fmt: skip
    return out.view(*lead, n)
