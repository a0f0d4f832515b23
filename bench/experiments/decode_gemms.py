#!/usr/bin/env python
"""The 8B shape's decode products at 64 rows through cuBLAS, three ways (issue 18): F.linear as
the model calls it (torch's default BLAS path), the same with torch's cuBLASLt path
(``torch.backends.cuda.preferred_blas_library("cublaslt")``), and the swapped product
W @ x^T (64 output columns; the transpose back to rows included, since the model needs rows).
Each is 32 distinct weights back to back in a CUDA graph (so every weight comes from DRAM),
timed as one replay per call; the share of the copy ceiling reads the weights alone.

    python bench/decode_gemms.py --rows 64 --json-out gemms.json
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from common import format_table, write_json
from gpu import copy_ms
from tp_micro import graph_us  # bench/ on sys.path (PYTHONPATH=bench)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64])
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    n = 1 << 30
    copy_gbps = 2 * 2 * n / copy_ms(n) / 1e6
    print(f"copy {copy_gbps:.0f} GB/s", flush=True)
    default = torch.backends.cuda.preferred_blas_library()
    rows_out: list[list[Any]] = []
    for name, (out_f, in_f) in SHAPES.items():
        ws = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        bound_us = out_f * in_f * 2 / copy_gbps / 1e3
        for m in args.rows:
            x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0]).float()
            variants = {
                "linear": lambda x=x, ws=ws: [F.linear(x, w) for w in ws],
                "swap": lambda x=x, ws=ws: [torch.mm(w, x.t()).t().contiguous() for w in ws],
            }
            row: list[Any] = [name, m, round(bound_us, 1)]
            for lib in ("default", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(default if lib == "default" else lib)
                for fn in variants.values():
                    out = fn()[0].float()
                    err = float((out - ref).norm() / ref.norm())
                    us = graph_us(fn, 10) / LAYERS if err < 1e-2 else float("inf")
                    row += [round(us, 1), round(bound_us / us, 2)]
            torch.backends.cuda.preferred_blas_library(default)
            rows_out.append(row)
            print(row, flush=True)
        torch.cuda.empty_cache()
    head = ["product", "rows", "bound us"]
    for lib in ("default", "lt"):
        for v in ("linear", "swap"):
            head += [f"{lib} {v} us", "share"]
    print(format_table(head, rows_out))
    if args.json_out:
        write_json(args.json_out, {"copy_GBps": copy_gbps, "head": head, "rows": rows_out})


if __name__ == "__main__":
    main()
