#!/usr/bin/env python
"""Float32 linears on CPU, kernel against kernel (issue 19): SmolLM2-135M's 120 decoder linears
(qkv 576->960, o 576->576, gate_up 576->3,072, down 1,536->576, x 30 layers, random weights
of the real shapes) and its LM head (576 -> 49,152), at each row count, through

- MKL: torch's ``F.linear`` on the float parameter;
- oneDNN: ``torch.ops.mkldnn._linear_pointwise`` on its packed layout (inductor's CPU path);
- panels: radixserve's AVX2 kernel (plugins/hardware/cpu_kernels/f32_linear.cpp).

Prints ms per pass and GFLOP/s, and panels' speed as a ratio to the faster peer, all in one
process. The weights (540 MB per copy) do not fit in cache, as in a decode step.

    python bench/cpu_f32_linear.py
    python bench/cpu_f32_linear.py --rows 1 8 32 --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from common import num_cores
from tqdm import tqdm

from radixserve.plugins.hardware.cpu_linear import PanelPacking, default_packing

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
HEAD = (49152, 576)


def seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32, 64, 128, 256, 1024])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=num_cores())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not isinstance(default_packing(), PanelPacking):
        raise SystemExit("radixserve's AVX2 kernels do not run here (no AVX2 + FMA build)")
    panels = PanelPacking()
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * args.layers
    weights = [torch.randn(shape, generator=gen) * 0.02 for shape in tqdm(shapes, desc="weights")]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    ours = [panels.pack(w) for w in weights]
    head = torch.randn(HEAD, generator=gen) * 0.02
    head_onednn, head_ours = torch.ops.mkldnn._reorder_linear_weight(head, 8), panels.pack(head)
    packed = {
        "shapes": shapes, "weights": weights, "onednn": onednn, "ours": ours, "head": head,
        "head_onednn": head_onednn, "head_ours": head_ours, "panels": panels,
    }  # fmt: skip
    print(f"threads={args.threads}; {len(shapes)} linears + the LM head, float32")
    print("what       rows  MKL ms  oneDNN ms  panels ms  MKL GF/s  oneDNN GF/s  panels GF/s  "
          "panels vs best")  # fmt: skip
    for rows in tqdm(args.rows, desc="rows"):
        for what, (case_flops, calls, fns) in cases_for(rows, packed, gen).items():
            t = [seconds_per_call(fn, calls) for fn in fns]
            gf = [case_flops / s / 1e9 for s in t]
            print(f"{what:<9} {rows:>5}  {t[0] * 1e3:>6.1f}  {t[1] * 1e3:>9.1f}  "
                  f"{t[2] * 1e3:>9.1f}  {gf[0]:>8.0f}  {gf[1]:>11.0f}  {gf[2]:>11.0f}  "
                  f"{min(t[0], t[1]) / t[2]:>13.2f}x")  # fmt: skip


def cases_for(
    rows: int, packed: dict[str, Any], gen: torch.Generator
) -> dict[str, tuple[int, int, list[Callable[[], object]]]]:
    """what -> (FLOPs, calls to time, [MKL, oneDNN, panels] passes) at ``rows`` rows."""
    shapes, weights, onednn, ours = (packed[k] for k in ("shapes", "weights", "onednn", "ours"))
    head, head_onednn, head_ours = (packed[k] for k in ("head", "head_onednn", "head_ours"))
    panels = packed["panels"]
    xs = {k: torch.randn(rows, k, generator=gen) for k in {576, 1536}}
    inputs = [xs[k] for _, k in shapes]
    flops = sum(2 * rows * n * k for n, k in shapes)
    return {
        "decoder": (
            flops,
            max(2, min(20, int(2e11 / flops))),
            [
                lambda: [F.linear(x, w) for x, w in zip(inputs, weights, strict=True)],
                lambda: [
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                    for x, w in zip(inputs, onednn, strict=True)
                ],
                lambda: [
                    panels(x, w, n, None) for x, w, (n, _) in zip(inputs, ours, shapes, strict=True)
                ],
            ],
        ),
        "head": (
            2 * rows * HEAD[0] * HEAD[1],
            max(2, min(20, int(2e11 / flops))),
            [
                lambda: F.linear(xs[576], head),
                lambda: torch.ops.mkldnn._linear_pointwise(
                    xs[576], head_onednn, None, "none", [], ""
                ),  # fmt: skip
                lambda: panels(xs[576], head_ours, HEAD[0], None),
            ],
        ),
    }


if __name__ == "__main__":
    main()
