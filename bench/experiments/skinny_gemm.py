#!/usr/bin/env python
"""Decode-step products of a few dozen rows on the GPU: cuBLAS (``F.linear``, what the model
runs) against a Triton tile kernel (below) over a sweep of its launch settings (issue 18).

The kernel: each program owns BLOCK_N output columns for every row over one of SPLIT_K ranges
of K and streams its strip of W once, in BLOCK_K-wide tiles pipelined over NUM_STAGES; with
``SWAP`` the MMA's wide side is W's rows and the tokens the narrow side, as in swap-AB kernels;
the last split of a column block to finish (an atomic counter, which it resets) sums the float32
partials in split order and stores the rows, in the same launch. ``down_silu`` is the down
projection with SiLU(gate) * up computed inside (against silu_mul then cuBLAS).

It is not in the model. Splitting K lost everywhere; unsplit it beat cuBLAS by 3-15% on some
shapes in isolation, but wired into the decoder (commit e918dce) the 64-request workload's
decode steps took as long as with cuBLAS (7.21 vs 7.19 ms, bench/HISTORY.md).

For each weight shape of the 8B model's layers and each row count, 32 distinct weights are
multiplied back to back in a CUDA graph (so L2 holds none of them); the table gives us per
product, the ratio of its weight read to the copy ceiling measured in the same run, and the
best configuration against cuBLAS. Results are checked against cuBLAS.

    python bench/skinny_gemm.py --rows 16 32 64 --json-out skinny.json
    python bench/skinny_gemm.py --sweep short-k --rows 64 32 --shapes o qkv down
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import format_table, machine_info, write_json
from gpu import ceilings
from tp_micro import graph_us

from radixserve.plugins.models.fused_ops import silu_mul

Config = tuple[int, int, int, int, int, bool]  # (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, swap)
#: column blocks the merge counters cover
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


_counters: dict[str, torch.Tensor] = {}


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, cfg: Config, silu: bool = False
) -> torch.Tensor:
    """x [M, K] (or [M, 2K] = [gate | up] with ``silu``) @ weight[N, K].T -> [M, N], M <= 64.
    The merge counters (zeroed, left zeroed) are made on the first call, outside any graph."""
    m = x.shape[0]
    n, k = weight.shape
    bn, bk, split, warps, stages, swap = cfg
    if str(x.device) not in _counters:
        _counters[str(x.device)] = torch.zeros(
            MAX_COLUMN_BLOCKS, dtype=torch.int32, device=x.device
        )
    counters = _counters[str(x.device)]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    _skinny_kernel[(n // bn, split)](
        x, weight, y, part, counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
        SWAP=swap, SILU=silu, NUM_STAGES=stages, PRECISION="tf32", num_warps=warps,
    )  # fmt: skip
    return y


#: name -> (N, K, silu): the 8B shape's products; down_silu takes [gate | up] (SiLU inside)
SHAPES = {
    "qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, False),
    "down": (4096, 14336, False), "down_silu": (4096, 14336, True),
}  # fmt: skip
COPIES = 32
CONFIGS: list[Config] = [
    (bn, bk, split, 4, stages, swap)
    for bn, bk, split, stages, swap in itertools.product(
        (32, 64, 128), (128, 256), (1, 2, 4, 8), (4,), (False, True)
    )
    if not (bn == 128 and bk == 256)  # shared memory
]
#: ``--sweep short-k``: shorter K tiles and fewer stages, so several programs fit on one
#: multiprocessor and a split's short K range is not all pipeline fill and drain
SHORT_K_CONFIGS: list[Config] = [
    (bn, bk, split, 4, stages, swap)
    for bn, bk, split, stages, swap in itertools.product(
        (32, 64), (64, 128), (1, 2, 4), (2, 3, 5), (False, True)
    )
]


def bench_shape(name: str, rows: list[int], configs: list[Config]) -> list[dict[str, Any]]:
    """Every row count of one weight shape: cuBLAS (with silu_mul first for down_silu) and each
    configuration, us per product."""
    n, k, silu = SHAPES[name]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(COPIES)]  # fmt: skip
    out = []
    for m in rows:
        x = torch.randn(m, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)

        def cublas_run(x: torch.Tensor = x) -> list[torch.Tensor]:
            return [F.linear(silu_mul(x) if silu else x, w) for w in weights]

        out.append({"shape": name, "rows": m, "cfg": "cublas", "us": graph_us(cublas_run) / COPIES})
        want = F.linear(silu_mul(x) if silu else x, weights[0]).float()
        for cfg in configs:
            if n % cfg[0] or k % (cfg[1] * cfg[2]):
                continue

            def run(x: torch.Tensor = x, cfg: Any = cfg) -> list[torch.Tensor]:
                return [skinny_gemm(x, w, cfg, silu) for w in weights]

            try:
                got = skinny_gemm(x, weights[0], cfg, silu).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 2e-2:
                    print(f"{name} m={m} {cfg}: wrong (rel err {err:.3f})", flush=True)
                    continue
                us = graph_us(run) / COPIES
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile
                print(f"{name} m={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            out.append({"shape": name, "rows": m, "cfg": cfg, "us": us})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sweep", default="base", choices=["base", "short-k"])
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    configs = CONFIGS if args.sweep == "base" else SHORT_K_CONFIGS
    ceil = ceilings()
    print(f"ceilings: {ceil}", flush=True)
    res: dict[str, Any] = {"machine": machine_info(), "ceilings": ceil, "results": []}
    table = []
    for name in args.shapes:
        results = bench_shape(name, args.rows, configs)
        res["results"] += results
        torch.cuda.empty_cache()
        n, k, _ = SHAPES[name]
        for m in args.rows:
            mine = [r for r in results if r["rows"] == m]
            cublas = next(r["us"] for r in mine if r["cfg"] == "cublas")
            best = min((r for r in mine if r["cfg"] != "cublas"), key=lambda r: r["us"])
            share = [
                n * k * 2 / (us / 1e6) / 1e9 / ceil["copy_GBps"] for us in (cublas, best["us"])
            ]
            table.append([
                name, m, f"{cublas:.1f}", f"{share[0]:.2f}", f"{best['us']:.1f}", f"{share[1]:.2f}",
                f"{cublas / best['us']:.2f}", str(best["cfg"]),
            ])  # fmt: skip
            print(table[-1], flush=True)
        if args.json_out:
            write_json(args.json_out, res)
    print(format_table(
        ["shape", "rows", "cuBLAS us", "of copy bw", "best us", "of copy bw", "cuBLAS / best",
         "best (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, swap)"], table,
    ))  # fmt: skip
    if args.json_out:
        write_json(args.json_out, res)


if __name__ == "__main__":
    main()
