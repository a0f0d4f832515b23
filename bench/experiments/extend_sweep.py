#!/usr/bin/env python
"""Prefill (extend) attention launch sweep on the GPU (issue 18): TFLOP/s of the Triton extend
kernel for its launch settings (plugins/attention/triton/extend_kernel.GPU_CONFIG), at
Llama-3.1-8B heads (32 q / 8 KV, dim 128, bf16), page size 1, on the prefill chunks of
bench/gpu.py's workloads: 8 requests x 1,024 new tokens (no prefix), and 8 x 1,024 new over
1,024 cached ones. Each setting is checked against the current one before it is timed.

    python bench/extend_sweep.py --json-out extend.json
    python bench/extend_sweep.py --grid flags    # a few block settings x the two loop switches

The loop switches (GPU_CONFIG's ``heavy_first``: last query block launched first; ``split_mask``:
the keys before a query block attended without the causal mask) change no bits of the output.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
from common import format_table, write_json
from tp_micro import graph_us

from radixserve.plugins.attention.triton import extend_kernel as ek

HEADS, KV_HEADS, DIM = 32, 8, 128
CASES = [(8, 1024, 0), (8, 1024, 1024)]  # (requests, new tokens, cached prefix)


def make_case(reqs: int, new: int, prefix: int) -> dict[str, Any]:
    """Each request's slots contiguous, as a fresh pool hands them out; K/V of the whole
    sequence in the pool (the backend stores the new tokens' before it attends)."""
    dev, seq = "cuda", new + prefix
    k = torch.randn(reqs * seq + 1, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16)
    table = (torch.arange(reqs * seq, device=dev) + 1).to(torch.int32).view(reqs, seq)
    i32 = dict(device=dev, dtype=torch.int32)
    causal_pairs = new * (new + 1) / 2 + new * prefix
    return {
        "q": torch.randn(reqs * new, HEADS, DIM, device=dev, dtype=torch.bfloat16),
        "k": k, "v": torch.randn_like(k), "table": table,
        "rows": torch.arange(reqs, **i32), "seq": torch.full((reqs,), seq, **i32),
        "ext": torch.full((reqs,), new, **i32), "starts": torch.arange(reqs, **i32) * new,
        "new": new, "flops": reqs * HEADS * causal_pairs * DIM * 4,
    }  # fmt: skip


def run(c: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    out = torch.empty_like(c["q"])
    args = (c["q"], c["k"], c["v"], out, c["table"], c["rows"], c["seq"], c["ext"], c["starts"],
            c["new"], DIM**-0.5)  # fmt: skip
    return out, lambda: ek.extend_attention(*args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json-out", default=None)
    p.add_argument("--grid", choices=("launch", "flags"), default="launch")
    args = p.parse_args()
    cases = [make_case(*c) for c in CASES]
    refs = []
    for c in cases:
        out, fn = run(c)
        fn()
        refs.append(out.float())
    default = dict(ek.GPU_CONFIG)
    rows: list[list[Any]] = []
    if args.grid == "launch":
        flags = [(default["heavy_first"], default["split_mask"])]
        grid = [(*s, *f) for s in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3))
                for f in flags]  # fmt: skip
    else:
        blocks = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3)]
        grid = [(*b, h, m) for b in blocks for h in (0, 1) for m in (0, 1)]
    for bm, bn, warps, stages, heavy, split in grid:
        ek.GPU_CONFIG.update(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                             heavy_first=heavy, split_mask=split)  # fmt: skip
        row: list[Any] = [bm, bn, warps, stages, int(heavy), int(split)]
        for c, ref in zip(cases, refs, strict=True):
            try:
                out, fn = run(c)
                # in a CUDA graph: timed alone, a launch also times Triton's host-side launch
                ms = graph_us(lambda fn=fn: [fn() for _ in range(4)], 10) / 4e3
                err = float((out.float() - ref).norm() / ref.norm())
                row += [ms, c["flops"] / ms / 1e9 if err < 1e-2 else 0.0]
            except Exception as e:  # noqa: BLE001 - a setting that does not compile
                print(f"{row[:6]}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                row += [None, 0.0]
        rows.append(row)
        print(row, flush=True)
    ek.GPU_CONFIG.update(default)
    head = ["BLOCK_M", "BLOCK_N", "warps", "stages", "heavy_first", "split_mask"]
    for reqs, new, prefix in CASES:
        head += [f"{reqs}x{new}+{prefix} ms", "TFLOP/s"]
    rows.sort(key=lambda r: -(r[7] + r[9]))
    print(format_table(head, rows))
    if args.json_out:
        write_json(args.json_out, {"default": default, "rows": rows, "head": head})


if __name__ == "__main__":
    main()
