#!/usr/bin/env python
"""Decode-step products of a few dozen rows on the GPU: cuBLAS (``F.linear``, what the model
runs) against a plain Triton tile kernel (below) over a sweep of its launch settings (issue 18).

The kernel: each program owns BLOCK_N output columns for every row and streams its strip of W
once, in BLOCK_K-wide tiles pipelined over NUM_STAGES; with ``SWAP`` the MMA's wide side is W's
rows and the tokens the narrow side, as in swap-AB kernels. It is not in the model: at 64 rows
it beat cuBLAS on the gate_up and down shapes only, by 3-8% (docs/BENCHMARKS.md).

For each weight shape of the 8B model's layers (qkv, o, gate_up, down) and each row count, 32
distinct weights are multiplied back to back in a CUDA graph (so L2 holds none of them); the
table gives us per product, GB/s of weight read, the ratio to the copy ceiling measured in the
same run, and the best configuration against cuBLAS. Results are checked against cuBLAS.

    python bench/skinny_gemm.py --rows 16 32 64 --json-out skinny.json
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

Config = tuple[int, int, int, int, bool]  # (BLOCK_N, BLOCK_K, warps, stages, swap)


@triton.jit
def _skinny_gemm_kernel(
    X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m < M
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        x = tl.load(
            X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=rows[:, None], other=0.0
        )
        w = tl.load(w_rows + offs_k[None, :])
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out = acc.to(Y.dtype.element_ty)
    if SWAP:
        ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(ptrs, out, mask=rows[None, :])
    else:
        ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(ptrs, out, mask=rows[:, None])


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, cfg: Config) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N], M <= 64."""
    m, k = x.shape
    n = weight.shape[0]
    bn, bk, warps, stages, swap = cfg
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(n // bn,)](
        x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk, SWAP=swap,
        NUM_STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return y


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 32
CONFIGS = [
    (bn, bk, warps, stages, swap)
    for bn, bk, warps, stages, swap in itertools.product(
        (32, 64, 128), (64, 128, 256), (4,), (3, 4), (False, True)
    )
    if not (bn == 128 and bk == 256)  # shared memory
]


def bench_shape(name: str, rows: list[int]) -> list[dict[str, Any]]:
    """Every row count of one weight shape: cuBLAS and each configuration, us per product."""
    n, k = SHAPES[name]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(COPIES)]  # fmt: skip
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

        def cublas_run(x: torch.Tensor = x) -> list[torch.Tensor]:
            return [F.linear(x, w) for w in weights]

        out.append({"shape": name, "rows": m, "cfg": "cublas", "us": graph_us(cublas_run) / COPIES})
        want = F.linear(x, weights[0]).float()
        for cfg in CONFIGS:
            if n % cfg[0] or k % cfg[1]:
                continue

            def run(x: torch.Tensor = x, cfg: Any = cfg) -> list[torch.Tensor]:
                return [skinny_gemm(x, w, cfg) for w in weights]

            try:
                got = skinny_gemm(x, weights[0], cfg).float()
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
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    ceil = ceilings()
    print(f"ceilings: {ceil}", flush=True)
    res: dict[str, Any] = {"machine": machine_info(), "ceilings": ceil, "results": []}
    table = []
    for name in args.shapes:
        results = bench_shape(name, args.rows)
        res["results"] += results
        torch.cuda.empty_cache()
        n, k = SHAPES[name]
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
    print(format_table(
        ["shape", "rows", "cuBLAS us", "of copy bw", "best us", "of copy bw", "cuBLAS / best",
         "best (BLOCK_N, BLOCK_K, warps, stages, swap)"], table,
    ))  # fmt: skip
    if args.json_out:
        write_json(args.json_out, res)


if __name__ == "__main__":
    main()
