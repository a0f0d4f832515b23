#!/usr/bin/env python
"""Decode-attention launch sweep at batch 64 with the engine's slot layout (issue 18): the KV
pool as bench/gpu.py's 64 x (1,024 + 256) workload leaves it at page size 1, each request's
prompt in consecutive slots and its decoded tokens one slot per step, interleaved with the
other requests' (bench/experiments/gpu_kernels.py sweeps random slots instead, which no engine run
has). Times the Triton split-K kernel (plugins/attention/triton/decode_kernel.py) for split counts
and launch settings at three context lengths of the run, at Llama-3.1-8B heads (32 q / 8 KV,
dim 128, bf16), as LAYERS launches replayed in a CUDA graph (a single
launch timed with events also times Triton's host-side launch, tens of us: the first run of
this script did that); each setting is checked against the current one before it is timed.

    python bench/decode_sweep.py --json-out decode-sweep.json

The best row's settings go to the engine as RADIXSERVE_TRITON_DECODE="block_n=..,splits=..",
e.g. through bench/experiments/gpu_env_ab.py; ``--best-out FILE`` writes that string (empty when the
current settings are the best).
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
from common import format_table, write_json
from tp_micro import graph_us  # bench/ on sys.path (PYTHONPATH=bench)

from radixserve.plugins.attention.triton import decode_kernel as dk

HEADS, KV_HEADS, DIM = 32, 8, 128
BATCH, PROMPT, DECODED = 64, 1024, 256
CONTEXTS = (1040, 1168, 1270)  # early in the run, its mean, late
LAYERS = 8  # launches per graph, each over its own K/V buffers


def make_case(ctx: int) -> dict[str, Any]:
    """Slot 0 is padding; request i's prompt at 1 + i * PROMPT ..., its decoded token j at
    1 + BATCH * PROMPT + j * BATCH + i."""
    dev = "cuda"
    slots = 1 + BATCH * (PROMPT + DECODED)
    k = [torch.randn(slots, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    i = torch.arange(BATCH, device=dev)[:, None]
    pos = torch.arange(ctx, device=dev)[None, :]
    prompt = 1 + i * PROMPT + pos
    decoded = 1 + BATCH * PROMPT + (pos - PROMPT) * BATCH + i
    table = torch.where(pos < PROMPT, prompt, decoded).to(torch.int32)
    return {
        "q": torch.randn(BATCH, HEADS, DIM, device=dev, dtype=torch.bfloat16),
        # every launch reads the same K/V: a layer's ~300 MB does not stay in the 50 MB L2
        "k": [k[0]] * LAYERS, "v": [k[1]] * LAYERS, "table": table.contiguous(),
        "rows": torch.arange(BATCH, device=dev, dtype=torch.int32),
        "lens": torch.full((BATCH,), ctx, device=dev, dtype=torch.int32),
        "bytes": 2 * BATCH * ctx * KV_HEADS * DIM * 2,
    }  # fmt: skip


def run(c: dict[str, Any], config: dict[str, int], sms: int) -> tuple[torch.Tensor, Any]:
    splits = dk.num_decode_splits(BATCH, KV_HEADS, sms, config)
    out = torch.empty_like(c["q"])
    po = torch.empty(BATCH, HEADS, splits, DIM, device="cuda")
    pl = torch.empty(BATCH, HEADS, splits, device="cuda")
    counters = dk.new_counters(BATCH, KV_HEADS, torch.device("cuda"))

    def once() -> None:
        for k, v in zip(c["k"], c["v"], strict=True):
            dk.decode_attention(c["q"], k, v, c["table"], c["rows"], c["lens"], out, po, pl,
                                DIM**-0.5, counters=counters, config=config)  # fmt: skip

    return out, once


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json-out", default=None)
    p.add_argument("--best-out", default=None)
    p.add_argument("--splits", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    current = dk.decode_config()
    cases = [make_case(ctx) for ctx in CONTEXTS]
    refs = []
    for c in cases:
        out, fn = run(c, current, sms)
        fn()
        refs.append(out.float())
    cur_splits = dk.num_decode_splits(BATCH, KV_HEADS, sms, current)
    now = (cur_splits, current["block_n"], current["num_warps"], current["num_stages"])
    grid = itertools.product(args.splits, args.block_n, args.warps, args.stages)
    rows: list[list[Any]] = []
    for splits, block_n, warps, stages in grid:
        config = {**current, "splits": splits, "block_n": block_n, "num_warps": warps,
                  "num_stages": stages}  # fmt: skip
        mark = "*" if (splits, block_n, warps, stages) == now else ""
        row: list[Any] = [f"{splits}{mark}", block_n, warps, stages]
        total = 0.0
        for c, ref in zip(cases, refs, strict=True):
            try:
                out, fn = run(c, config, sms)
                us = graph_us(fn, 20) / LAYERS
                err = float((out.float() - ref).norm() / ref.norm())
                if err > 1e-2:
                    us = float("inf")  # a wrong result never wins
            except Exception as e:  # noqa: BLE001 - a setting that does not compile
                print(f"{row}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                us = float("inf")
            row += [round(us, 1), round(c["bytes"] / us / 1e3)]
            total += us
        rows.append([*row, round(total, 1)])
        print(rows[-1], flush=True)
    head = ["splits", "block_n", "warps", "stages"]
    for ctx in CONTEXTS:
        head += [f"64x{ctx} us", "GB/s"]
    head.append("sum us")
    rows.sort(key=lambda r: r[-1])
    print(format_table(head, rows))
    print(f"current: splits {cur_splits}, {current}")
    best = rows[0]
    spec = ""
    if not str(best[0]).endswith("*"):
        spec = f"splits={best[0]},block_n={best[1]},num_warps={best[2]},num_stages={best[3]}"
    print(f"best: {spec or 'the current settings'}")
    if args.best_out:
        with open(args.best_out, "w") as f:
            f.write(spec)
    if args.json_out:
        write_json(args.json_out, {"current": current, "head": head, "rows": rows})


if __name__ == "__main__":
    main()
