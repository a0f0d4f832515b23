#!/usr/bin/env python
"""Deterministic mode's linears, kernel against kernel: ``F.linear`` (cuBLAS, not
batch-invariant), the fixed row blocks of plugins/models/invariant_ops.py at R = 64, 128 and
256 rows (today's default: R = 64), and the Triton GEMM of plugins/models/invariant_gemm.py
(``RADIXSERVE_INVARIANT_GEMM=triton``), at Llama-3.1-8B's linears (qkv, o, gate_up, down) for
batches of 1 to 8,192 rows.

Each cell is microseconds per product (CUDA events over ``--iters`` calls after ``--warmup``;
the weights cycle through enough copies that L2 holds none of them between calls) and its
ratio to F.linear; ``inv`` says whether row 0 alone has the bits it has in the whole batch.
``--splits 1 4`` adds Triton variants with that fixed split of K (tuning the split rule of
``tiles_for``).

    PYTHONPATH=bench python bench/experiments/invariant_gemm.py --device cuda --json-out g.json
    PYTHONPATH=bench python bench/experiments/invariant_gemm.py --device cpu --small  # interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from common import format_table, write_json  # bench/ on sys.path (PYTHONPATH=bench)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [1, 16, 64, 256, 1024, 8192]
ROW_BLOCKS = [64, 128, 256]
SMALL_DIVISOR = 64  # --small: every dimension of SHAPES / 64, rows up to 64
COLD_BYTES = 256 << 20  # weights cycled per shape: more than an H100's or H200's L2

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def methods(splits: list[int]) -> dict[str, Product]:
    """Name -> product(x, weight) for each method compared."""
    from radixserve.plugins.models.invariant_gemm import invariant_linear, tiles_for
    from radixserve.plugins.models.invariant_ops import block_linear

    found: dict[str, Product] = {"F.linear": lambda x, w: F.linear(x, w)}
    for r in ROW_BLOCKS:
        found[f"R={r}"] = lambda x, w, r=r: block_linear(x, w, None, r)
    found["triton"] = lambda x, w: invariant_linear(x, w)
    for s in splits:

        def split(x: torch.Tensor, w: torch.Tensor, s: int = s) -> torch.Tensor:
            tiles = dataclasses.replace(tiles_for(w.shape[0], w.shape[1], w.dtype), splits=s)
            return invariant_linear(x, w, tiles=tiles)

        found[f"triton s={s}"] = split
    return found


def time_us(fn: Product, x: torch.Tensor, weights: list[torch.Tensor], args: Any) -> float:
    """Microseconds per call of ``fn(x, w)``, cycling through ``weights``."""
    for i in range(args.warmup):
        fn(x, weights[i % len(weights)])
    if x.device.type != "cuda":
        start_s = time.perf_counter()
        for i in range(args.iters):
            fn(x, weights[i % len(weights)])
        return (time.perf_counter() - start_s) / args.iters * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(args.iters):
        fn(x, weights[i % len(weights)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / args.iters * 1e3


def measure(name: str, n: int, k: int, products: dict[str, Product], args: Any) -> list[list[Any]]:
    """One table row per batch size of the [n, k] weight."""
    g = torch.Generator(device=args.device).manual_seed(0)
    dtype = getattr(torch, args.dtype)
    size = n * k * dtype.itemsize
    copies = max(1, -(-COLD_BYTES // size)) if args.device == "cuda" else 1
    weights = [torch.randn(n, k, generator=g, device=args.device).to(dtype) for _ in range(copies)]
    rows_out = []
    for m in args.rows:
        x = (torch.randn(m, k, generator=g, device=args.device) / k**0.5).to(dtype)
        row: list[Any] = [name, m]
        base_us = None
        for fn in products.values():
            batch = fn(x, weights[0])
            invariant = torch.equal(fn(x[:1], weights[0]), batch[:1])
            us = time_us(fn, x, weights, args)
            base_us = base_us or us
            row += [round(us, 1), round(us / base_us, 2), "yes" if invariant else "NO"]
        rows_out.append(row)
        print(row, flush=True)
    del weights
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows_out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: the Triton interpreter (TRITON_INTERPRET=1); with --small",
    )
    p.add_argument(
        "--small",
        action="store_true",
        help=f"every dimension / {SMALL_DIVISOR}, rows up to 64 (a smoke run)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rows", type=int, nargs="+", default=None, help=f"default {ROWS}")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="also time the Triton kernel with this fixed split of K")  # fmt: skip
    p.add_argument("--warmup", type=int, default=None, help="calls before timing (10; 1 small)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (50; 2 small)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is defined
    small = args.small
    args.rows = args.rows or ([r for r in ROWS if r <= 64] if small else ROWS)
    args.warmup = args.warmup if args.warmup is not None else (1 if small else 10)
    args.iters = args.iters or (2 if small else 50)
    products = methods(args.splits)
    rows_out: list[list[Any]] = []
    for name in args.shapes:
        n, k = SHAPES[name]
        if small:
            n, k = n // SMALL_DIVISOR, k // SMALL_DIVISOR
        rows_out += measure(name, n, k, products, args)
    head = ["linear", "rows"]
    for method in products:
        head += [f"{method} us", "x", "inv"]
    print(format_table(head, rows_out))
    if args.json_out:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
        write_json(args.json_out, {"device": device, "dtype": args.dtype, "small": small,
                                   "head": head, "rows": rows_out})  # fmt: skip


if __name__ == "__main__":
    main()
