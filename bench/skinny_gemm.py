#!/usr/bin/env python
"""Decode-step products of a few dozen rows on the GPU: cuBLAS (``F.linear``, what the model
runs without the kernel) against plugins/hardware/skinny_gemm.py over a sweep of its launch
settings (issue 18).

The kernel: each program owns BLOCK_N output columns for every row over one of SPLIT_K ranges
of K and streams its strip of W once, in BLOCK_K-wide tiles pipelined over NUM_STAGES; with
``SWAP`` the MMA's wide side is W's rows and the tokens the narrow side, as in swap-AB kernels;
the last split of a column block merges the splits in the same launch. ``down_silu`` is the down
projection with SiLU(gate) * up inside (against silu_mul then cuBLAS).

For each weight shape of the 8B model's layers and each row count, 32 distinct weights are
multiplied back to back in a CUDA graph (so L2 holds none of them); the table gives us per
product, the ratio of its weight read to the copy ceiling measured in the same run, and the
best configuration against cuBLAS. Results are checked against cuBLAS.

    python bench/skinny_gemm.py --rows 16 32 64 --json-out skinny.json
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from common import format_table, machine_info, write_json
from gpu import ceilings
from tp_micro import graph_us

from radixserve.plugins.hardware.skinny_gemm import Config, skinny_gemm
from radixserve.plugins.models.fused_ops import silu_mul

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
