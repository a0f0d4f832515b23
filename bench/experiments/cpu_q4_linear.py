#!/usr/bin/env python
"""The default model's decoder linears at one row, three ways in one process: float32
``F.linear``, torch's int4 weight-only kernel (``--quantization int4wo``) and the Q4_1 block
kernel of ``--quantization gguf`` (radixserve's CPU kernels), over 30 layers of SmolLM2-135M's
shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; random weights, ~66 MB as Q4_1
blocks, beyond the L3), plus the Q4_1 LM head screen (49,152 x 576) at 1 and 8 rows.
Prints the median of 7 passes each and the ratios to float32 and int4wo measured here.

    .venv/bin/python bench/cpu_q4_linear.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from radixserve.plugins.models import quant

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    trios = []
    for _ in range(args.layers):
        for out_f, in_f in SHAPES:
            linear = nn.Linear(in_f, out_f, bias=False)
            trios.append((linear, quant.Int4Linear(linear), quant.Q4BlockLinear(linear)))
    xs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}

    def one_pass(kind: int) -> float:
        start = time.perf_counter()
        for trio in trios:
            layer = trio[kind]
            layer(xs[layer.in_features])
        return time.perf_counter() - start

    names = ["float32 F.linear", "torch int4wo", "gguf Q4_1 blocks"]
    times: dict[int, list[float]] = {k: [] for k in range(3)}
    for k in range(3):
        one_pass(k)
    for _ in range(7):
        for k in range(3):  # alternating, so drift touches all three alike
            times[k].append(one_pass(k))
    median = {k: sorted(v)[3] for k, v in times.items()}
    print(f"{len(trios)} linears at one row, threads={args.threads}, median of 7 passes")
    for k, name in enumerate(names):
        ms = median[k] * 1e3
        print(f"{name:18} {ms:8.2f} ms  vs float32 {median[0] / median[k]:5.2f}x  "
              f"vs int4wo {median[1] / median[k]:5.2f}x")  # fmt: skip
    head = quant.quantize_q4_1(torch.randn(49152, 576) * 0.05)
    op = quant.q4_kernels().q4_1_linear
    for rows in (1, 8):
        x = torch.randn(rows, 576)
        op(x, head)
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            op(x, head)
            runs.append(time.perf_counter() - start)
        print(f"Q4_1 head screen 49152 x 576, {rows} row(s): {sorted(runs)[3] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
