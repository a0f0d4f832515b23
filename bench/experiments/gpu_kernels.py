#!/usr/bin/env python
"""Decode-attention launch sweep on the GPU: KV bytes read per second of the split-K decode
kernel for a few launch settings, at Llama-3.1-8B heads (32 q / 8 KV, dim 128, bf16) and
serving-sized batches; each setting is checked against the first one before it is timed.

    python bench/experiments/gpu_kernels.py   # the table; gpu.py --tune-decode applies the best

``--tune-moe``: the fused MoE kernels' tiles per token count at an expert shape (default
Qwen3-30B-A3B's: 128 experts of 768 x 2,048, top-8; ``--moe-shape E,I,H,K``; ``--fp8`` for FP8
experts): every candidate is checked against the default tiles' output, timed (median of CUDA
events), and the fastest per token count is written into
plugins/models/fused_moe_configs.json under the device's name (``--dry-run``: printed only).

    python bench/experiments/gpu_kernels.py --tune-moe --moe-tokens 1,2,4,8,16,32,64,128,256
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from gpu import median_ms  # bench/ is the script's own folder, first on sys.path

from radixserve.plugins.attention.triton import decode_kernel as dk

SHAPES = [(256, 1536), (64, 1152), (1, 640)]  # (batch, context): big runs, 64-batch, batch 1
HEADS, KV_HEADS, DIM = 32, 8, 128


def _case(bs: int, ctx: int) -> dict[str, Any]:
    slots = bs * ctx
    dev = "cuda"
    k = torch.randn(slots + 1, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = (torch.randperm(slots, device=dev) + 1).to(torch.int32).view(bs, ctx)
    return {
        "q": torch.randn(bs, HEADS, DIM, device=dev, dtype=torch.bfloat16),
        "k": k, "v": v, "table": table,
        "rows": torch.arange(bs, device=dev, dtype=torch.int32),
        "lens": torch.full((bs,), ctx, device=dev, dtype=torch.int32),
        "bytes": 2 * slots * KV_HEADS * DIM * 2,
    }  # fmt: skip


def _run(c: dict[str, Any], sms: int) -> tuple[torch.Tensor, Any]:
    bs = c["q"].shape[0]
    splits = dk.num_decode_splits(bs, KV_HEADS, sms)
    out = torch.empty_like(c["q"])
    po = torch.empty(bs, HEADS, splits, DIM, device="cuda")
    pl = torch.empty(bs, HEADS, splits, device="cuda")
    args = (c["q"], c["k"], c["v"], c["table"], c["rows"], c["lens"], out, po, pl, DIM**-0.5)
    return out, lambda: dk.decode_attention(*args)


def tune_decode() -> tuple[dict[str, Any], list[list[Any]]]:
    """Sweep launch settings; return the best (least time over the two large shapes) and rows."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [_case(bs, ctx) for bs, ctx in SHAPES]
    default = dict(dk.GPU_CONFIG)
    refs = []  # the current settings' results are the reference
    for c in cases:
        out, fn = _run(c, sms)
        fn()
        refs.append(out.float())
    rows, best, best_ms = [], default, float("inf")
    grid = itertools.product([64, 128], [4, 8], [2, 3], [8, 16])
    for block_n, warps, stages, ppsm in grid:
        dk.GPU_CONFIG.update(block_n=block_n, num_warps=warps, num_stages=stages,
                             programs_per_sm=ppsm)  # fmt: skip
        row: list[Any] = [block_n, warps, stages, ppsm]
        total = 0.0
        for c, ref in zip(cases, refs, strict=True):
            out, fn = _run(c, sms)
            ms = median_ms(fn, 20)
            err = float((out.float() - ref).norm() / ref.norm())
            if err > 1e-2:
                ms = float("inf")  # a wrong result never wins
            row += [ms * 1e3, c["bytes"] / ms / 1e6]
            total += ms if c["q"].shape[0] > 1 else 0.0
        rows.append(row)
        if total < best_ms:
            best, best_ms = dict(dk.GPU_CONFIG), total
    dk.GPU_CONFIG.clear()
    dk.GPU_CONFIG.update(best)
    return best, rows


def _moe_candidates(tokens: int) -> list[Any]:
    from radixserve.plugins.models.fused_moe import Tiles

    out = []
    for bm, bn, bk, warps, stages in itertools.product(
        (16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (2, 3, 4)
    ):
        if bm > 16 and tokens <= 8:
            continue  # a decode step's experts get a row or two each
        out.append(Tiles(bm, bn, bk, warps, stages))
        if tokens <= 4 and bm == 16:
            out.append(Tiles(bm, bn, bk, warps, stages, pair_blocks=True))
    return out


def _time_moe(args: tuple[torch.Tensor, ...], tile: Any, scales: Any) -> float:
    from radixserve.plugins.models import fused_moe

    return median_ms(lambda: fused_moe.fused_experts(*args, tile, scales), 50)


def tune_moe(shape: tuple[int, int, int, int], token_counts: list[int], fp8: bool) -> dict:
    """{tokens: best Tiles' fields} for the fused MoE kernels at ``shape`` (E, I, H, top-k)."""
    from radixserve.plugins.models import fused_moe
    from radixserve.plugins.models.fp8 import quantize_rows

    experts, inter, hidden, top_k = shape
    torch.manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    scales = None
    if fp8:
        q13, s13 = quantize_rows(w13.view(-1, hidden))
        q2, s2 = quantize_rows(w2.view(-1, inter))
        w13, w2 = q13.view(w13.shape), q2.view(w2.shape)
        scales = (s13.view(experts, -1), s2.view(experts, -1))
    best: dict[int, dict[str, Any]] = {}
    for t in token_counts:
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        probs = torch.softmax(torch.randn(t, experts, device="cuda"), -1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        default = fused_moe.default_tiles(t, t * top_k, experts)
        ref = fused_moe.fused_experts(x, w13, w2, weights, ids, default, scales).float()
        timed = []
        for tile in _moe_candidates(t):
            try:
                got = fused_moe.fused_experts(x, w13, w2, weights, ids, tile, scales).float()
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                print(f"  t={t} {tile}: {type(e).__name__}")
                continue
            if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()):
                print(f"  t={t} {tile}: WRONG, skipped")
                continue
            timed.append((_time_moe((x, w13, w2, weights, ids), tile, scales), tile))
        ms, tile = min(timed, key=lambda p: p[0])
        default_ms = _time_moe((x, w13, w2, weights, ids), default, scales)
        print(f"tokens {t}: {ms * 1000:.1f} us with {tile} (default {default_ms * 1000:.1f} us)")
        best[t] = tile._asdict()
    return best


def write_moe_table(shape: tuple[int, int, int, int], best: dict[int, Any]) -> None:
    import json

    from radixserve.plugins.models.fused_moe import CONFIGS

    table = json.loads(CONFIGS.read_text()) if CONFIGS.is_file() else {}
    device = table.setdefault(torch.cuda.get_device_name(), {})
    device[",".join(map(str, shape[:3]))] = {str(t): v for t, v in sorted(best.items())}
    CONFIGS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print("written:", CONFIGS)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tune-moe", action="store_true", help="tune the fused MoE kernels' tiles")
    p.add_argument("--moe-shape", default="128,768,2048,8", help="experts,inter,hidden,top_k")
    p.add_argument("--moe-tokens", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--fp8", action="store_true", help="FP8 experts (--quantization fp8)")
    p.add_argument("--dry-run", action="store_true", help="print the best tiles, write nothing")
    args = p.parse_args()
    if args.tune_moe:
        shape = tuple(int(v) for v in args.moe_shape.split(","))
        assert len(shape) == 4, "--moe-shape E,I,H,top_k"
        best = tune_moe(shape, [int(t) for t in args.moe_tokens.split(",")], args.fp8)  # type: ignore[arg-type]
        if not args.dry_run:
            write_moe_table(shape, best)  # type: ignore[arg-type]
        return
    best, rows = tune_decode()
    head = ["block_n", "warps", "stages", "prog/SM"]
    for bs, ctx in SHAPES:
        head += [f"b{bs}x{ctx} us", "GB/s"]
    print("  ".join(f"{h:>10}" for h in head))
    for row in rows:
        print("  ".join(f"{v:>10.0f}" if isinstance(v, float) else f"{v:>10}" for v in row))
    print("best:", best)


if __name__ == "__main__":
    main()
