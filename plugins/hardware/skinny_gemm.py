"""A Triton product for decode steps of a few dozen rows (2 <= M <= 64), split over K with the
splits merged in the same launch (issue 18; the decoder skeleton uses it on CUDA where ``pick``
has a configuration for the shape, unless RADIXSERVE_TRITON_SKINNY=0).

At a few dozen rows a decoder's products are still bound by reading the weights, but the
attention block's matrices have too few column blocks to keep 132 multiprocessors streaming:
cuBLAS read the 8B shape's qkv and o weights at 0.65-0.75 of the copy bandwidth at 64 rows
(docs/BENCHMARKS.md). Here each program owns BLOCK_N output columns of every row over one of
SPLIT_K ranges of K, so there are SPLIT_K times more programs, each streaming its strip of W
once. Its float32 partial goes to a scratch buffer; the last program of a column block to finish
(an atomic counter, which it resets) sums the partials in split order, so the result does not
depend on which program finished last, and stores the rows. With ``silu`` the input is
[gate | up] and the product's input SiLU(gate) * up, rounded as ``fused_ops.silu_mul`` rounds it:
the down projection then needs no activation kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_ROWS = 64
#: column blocks the merge counters cover (N / BLOCK_N of the widest product split over K)
MAX_COLUMN_BLOCKS = 4096


@triton.jit
def _skinny_input(x_rows, offs_k, rows, K, SILU: tl.constexpr, dtype: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] input tile at columns ``offs_k`` (SiLU(gate) * up with SILU)."""
    if SILU:  # X = [gate | up], rounded as silu_mul rounds
        gate = tl.load(x_rows + offs_k[None, :], mask=rows[:, None], other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + offs_k[None, :], mask=rows[:, None], other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (act * up).to(dtype)
    return tl.load(x_rows + offs_k[None, :], mask=rows[:, None], other=0.0)


@triton.jit
def _skinny_kernel(
    X, W, Y, Part, Counters, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SWAP: tl.constexpr, SILU: tl.constexpr, NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = Y.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m < M
    x_rows = X + offs_m[:, None] * stride_xm
    # The weights are read once: first out of L2, so the partials and the input stay there.
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    k_len = K // SPLIT_K
    k_start = pid_k * k_len
    if SWAP:  # the MMA's wide side is W's rows, the tokens the narrow one (swap-AB)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(k_start, k_start + k_len, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        x = _skinny_input(x_rows, offs_k, rows, K, SILU, dtype)
        w = tl.load(w_rows + offs_k[None, :], eviction_policy="evict_first")
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(dtype), mask=rows[:, None])
    else:
        part = Part + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, acc, mask=rows[:, None])
        # Every thread's partial is stored before the counter's release; the program that
        # takes the counter to SPLIT_K acquires them all, sums them in split order, resets it.
        tl.debug_barrier()
        counter = Counters + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * M * N, mask=rows[:, None], other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            tl.store(y_ptrs, total.to(dtype), mask=rows[:, None])
            tl.atomic_xchg(counter, 0)


Config = tuple[int, int, int, int, int, bool]  # (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, swap)

#: H200, bfloat16, the 8B shape's products (bench/skinny_gemm.py, rows 16 / 32 / 64, 2026-12-03):
#: (N, K, silu) -> {BLOCK_M: config}, where the best configuration beat cuBLAS by 3% or more.
#: Not here, so cuBLAS: qkv at 32-64 rows and o at 64 (cuBLAS as fast or faster), gate_up below
#: 33 rows (even), SiLU inside the down projection (0.5-0.8x cuBLAS: each program recomputes
#: the activation of its whole input tile). Splitting K over more than 2 programs lost
#: everywhere: at 64 rows, qkv 17.3 -> 30.2 us with 4 splits.
TABLE: dict[tuple[int, int, bool], dict[int, Config]] = {
    (6144, 4096, False): {16: (64, 256, 1, 4, 4, True)},  # qkv: 15.9 -> 15.3 us
    (4096, 4096, False): {16: (64, 256, 1, 4, 4, True), 32: (64, 256, 1, 4, 4, True)},  # o
    (4096, 14336, False): {  # down: 33.4 -> 31.8, 34.2 -> 32.8, 36.3 -> 34.1 us
        16: (64, 256, 2, 4, 4, True),
        32: (64, 256, 2, 4, 4, True),
        64: (32, 256, 1, 4, 4, False),
    },
    (28672, 4096, False): {64: (128, 128, 1, 4, 4, False)},  # gate_up: 63.1 -> 61.3 us
}
#: fewer rows than this stay with cuBLAS: the table was measured from 16 rows up
MIN_PICKED_ROWS = 9

_counters: dict[str, torch.Tensor] = {}


def enabled() -> bool:
    """RADIXSERVE_TRITON_SKINNY: "0" off, else on where ``pick`` has a configuration."""
    return os.environ.get("RADIXSERVE_TRITON_SKINNY", "1") != "0"


def block_m(m: int) -> int:
    """The row block a product of ``m`` rows compiles for (tl.dot needs 16 at least)."""
    return max(16, triton.next_power_of_2(m))


def pick(n: int, k: int, m: int, silu: bool = False) -> Config | None:
    """The measured configuration for an [m, k] x [n, k]^T product, or None (cuBLAS)."""
    if m < MIN_PICKED_ROWS or m > MAX_ROWS:
        return None
    return TABLE.get((n, k, silu), {}).get(block_m(m))


def takes(x: torch.Tensor, weight: torch.Tensor, cfg: Config | None, silu: bool) -> bool:
    """Whether the kernel takes this product: 2..64 rows, whole blocks, unit strides."""
    if cfg is None:
        return False
    n, k = weight.shape
    bn, bk, split = cfg[:3]
    width = 2 * k if silu else k
    return (
        x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS and x.shape[1] == width
        and x.stride(-1) == 1 and weight.stride(-1) == 1 and x.dtype == weight.dtype
        and n % bn == 0 and k % (bk * split) == 0 and n // bn <= MAX_COLUMN_BLOCKS
    )  # fmt: skip


def counters(device: torch.device) -> torch.Tensor:
    """The zeroed merge counters of ``device`` (every launch leaves them zeroed). One set serves
    every product: a device's products run one after the other on the model's stream. Made
    before any CUDA graph is captured (``prepare``), so no capture allocates them."""
    key = str(device)
    if key not in _counters:
        _counters[key] = torch.zeros(MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)
    return _counters[key]


def prepare(device: torch.device | str) -> None:
    """Allocate ``device``'s counters now (at model construction)."""
    counters(torch.device(device))


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, cfg: Config, silu: bool = False
) -> torch.Tensor:
    """x [M, K] (or [M, 2K] = [gate | up] with ``silu``) @ weight[N, K].T -> [M, N]."""
    m = x.shape[0]
    n, k = weight.shape
    bn, bk, split, warps, stages, swap = cfg
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    precise = x.dtype == torch.float32  # tests on the CPU interpreter: no tf32 rounding
    _skinny_kernel[(n // bn, split)](
        x, weight, y, part, counters(x.device), m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m(m), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, SWAP=swap, SILU=silu,
        NUM_STAGES=stages, PRECISION="ieee" if precise else "tf32", num_warps=warps,
    )  # fmt: skip
    return y
