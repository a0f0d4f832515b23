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

``--lora``: the LoRA Triton backend's segmented kernels (plugins/models/lora_triton.py: a launch
pair per fused module) against the per-token kernels they replaced (kept below: one launch
pair per sub-projection) at Llama-3.1-8B's projections, rank 16, 8 adapters: prefill (8 x
1,024 tokens, one adapter each) and decode (64 rows, the adapters interleaved); a layer's four
wrapped modules captured in a CUDA graph each way, checked against each other, median time
and the ratio old / new. ``--lora-sweep``: that, then the segmented kernels at other tiles
(the five fastest per case, at more decode batch sizes; ``--write``: the fastest per row
count into plugins/models/lora_tiles.json under the GPU's name, which the kernels then use);
``--smoke``: tiny shapes, interpreted on the CPU, to check the
script (``TRITON_INTERPRET=1 ... --lora --smoke``).

    PYTHONPATH=bench python bench/experiments/gpu_kernels.py --lora-sweep --write
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import triton
import triton.language as tl
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


LLAMA8B = {"h": 4096, "q": 4096, "kv": 1024, "inter": 14336}

# -- the per-token LoRA kernels that plugins/models/lora_triton.py's segmented ones replaced
# (its version of 2026-12-05, commit 66e7b0f), kept here only to time the new ones against:
# one program per token reading its adapter's whole A, one launch pair per sub-projection


@triton.jit
def _old_shrink(x_ptr, a_ptr, slots_ptr, out_ptr, K, R, stride_x, stride_as, stride_ar,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if s > 0:
        a_row = a_ptr + (s - 1).to(tl.int64) * stride_as
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k < K, other=0.0)
            a = tl.load(a_row + r[:, None] * stride_ar + k[None, :],
                        mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)  # fmt: skip
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * R + r, acc, mask=r < R)


@triton.jit
def _old_expand(h_ptr, b_ptr, scale_ptr, slots_ptr, y_ptr, N, R, offset, stride_y, stride_bs,
                stride_bn, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    s = tl.load(slots_ptr + t)
    if s > 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + t.to(tl.int64) * R + r, mask=r < R, other=0.0)
        b = tl.load(b_ptr + (s - 1).to(tl.int64) * stride_bs + n[:, None] * stride_bn + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)  # fmt: skip
        d = tl.sum(b.to(tl.float32) * h[None, :], axis=1) * tl.load(scale_ptr + s - 1)
        dst = y_ptr + t.to(tl.int64) * stride_y + offset + n
        y = tl.load(dst, mask=n < N, other=0.0)
        tl.store(dst, (y.to(tl.float32) + d).to(y.dtype), mask=n < N)


def old_add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
    slots: torch.Tensor, offset: int,
) -> None:  # fmt: skip
    """The per-token launch pair of one sub-projection: y[:, offset:] += its product."""
    t, k = x.shape
    _, n, r = b.shape
    if t == 0:
        return
    x = x.contiguous()
    h = torch.empty(t, r, dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(r)
    _old_shrink[(t,)](x, a, slots, h, k, r, x.stride(0), a.stride(0), a.stride(1),
                      BLOCK_R=block_r, BLOCK_K=64)  # fmt: skip
    block_n = 64
    _old_expand[(t, triton.cdiv(n, block_n))](
        h,
        b,
        scale,
        slots,
        y,
        n,
        r,
        offset,
        y.stride(0),
        b.stride(0),
        b.stride(1),
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )


def _lora_layer(dims: dict[str, int], rank: int, slots: int, dev: str) -> list[dict[str, Any]]:
    """A layer's four wrapped modules as LoRALayers stacks them (A along R, B by column)."""
    h, q, kv, inter = dims["h"], dims["q"], dims["kv"], dims["inter"]
    modules = [(h, [q, kv, kv]), (q, [h]), (h, [inter, inter]), (inter, [h])]
    out = []
    for k, sizes in modules:
        a = torch.randn(slots, len(sizes) * rank, k, device=dev) / k**0.5
        b = torch.randn(slots, sum(sizes), rank, device=dev) * 0.01
        cols = tuple((sum(sizes[:j]), n, sum(sizes[:j])) for j, n in enumerate(sizes))
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        out.append({"k": k, "n": sum(sizes), "a": a.to(dtype), "b": b.to(dtype), "cols": cols})
    return out


def _lora_fns(layer: list[dict[str, Any]], rows: torch.Tensor, rank: int) -> tuple:
    """(new, old) callables adding the layer's LoRA to fresh outputs, and those outputs."""
    from radixserve.plugins.models import lora_triton

    dev, dtype = rows.device, layer[0]["a"].dtype
    t, slots = rows.shape[0], layer[0]["a"].shape[0]
    scale = torch.full((slots,), 2.0, device=dev)
    order = torch.argsort(rows, stable=True).to(torch.int32)
    xs = [torch.randn(t, m["k"], device=dev, dtype=dtype) for m in layer]
    ys = {w: [torch.zeros(t, m["n"], device=dev, dtype=dtype) for m in layer] for w in "no"}

    def new() -> None:
        for m, x, y in zip(layer, xs, ys["n"], strict=True):
            lora_triton.add_lora(y, x, m["a"], m["b"], scale, rows, order, m["cols"])

    def per_token() -> None:
        for m, x, y in zip(layer, xs, ys["o"], strict=True):
            for j, (col, n, off) in enumerate(m["cols"]):
                a = m["a"][:, j * rank : (j + 1) * rank]
                old_add_lora(y, x, a, m["b"][:, col : col + n], scale, rows, off)

    return new, per_token, ys


def _graphed(fn: Any, dev: str) -> Any:
    if dev != "cuda":
        return fn
    fn()  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _sweep_lora_tiles(new: Any, ys: list[torch.Tensor]) -> tuple[int, int, int]:
    """Time ``new`` at other tiles (BLOCK_M, BLOCK_N, split_k) than lora_triton.tiles' choice,
    each checked against it; prints the five fastest and returns the fastest."""
    from radixserve.plugins.models import lora_triton

    choose = lora_triton.tiles
    for y in ys:
        y.zero_()
    new()
    refs = [y.float().clone() for y in ys]
    timed = [(median_ms(_graphed(new, "cuda"), 50), None)]  # the untuned choice, as a baseline
    try:
        for tile in itertools.product((16, 32, 64), (64, 128), (1, 2, 4, 8, 16)):
            lora_triton.tiles = lambda t, k, name=None, tile=tile: tile  # type: ignore[misc]
            for y in ys:
                y.zero_()
            new()
            errs = [float((y.float() - r).norm() / r.norm()) for y, r in zip(ys, refs, strict=True)]
            if max(errs) > 1e-2:
                print(f"  tiles {tile}: WRONG, skipped")
                continue
            timed.append((median_ms(_graphed(new, "cuda"), 50), tile))
    finally:
        lora_triton.tiles = choose
    print(f"  the untuned tiles: {timed[0][0] * 1e3:.1f} us")
    ranked = sorted(timed[1:])
    for ms, tile in ranked[:5]:
        print(f"  BLOCK_M, BLOCK_N, split_k = {tile}: {ms * 1e3:.1f} us")
    return ranked[0][1]


def write_lora_table(best: dict[int, tuple[int, int, int]]) -> None:
    """The fastest tiles per row count, under this GPU's name in lora_triton's table."""
    import json

    from radixserve.plugins.models.lora_triton import CONFIGS

    table = json.loads(CONFIGS.read_text()) if CONFIGS.is_file() else {}
    table[torch.cuda.get_device_name()] = {str(t): list(v) for t, v in sorted(best.items())}
    CONFIGS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print("written:", CONFIGS)


def bench_lora(smoke: bool, sweep: bool, write: bool = False) -> None:
    """Time a layer's LoRA (4 modules) per-token vs segmented, prefill and decode; with
    ``sweep``, other tiles too, at more decode batch sizes (``write``: into the table)."""
    dev = "cpu" if smoke else "cuda"
    dims = {"h": 64, "q": 64, "kv": 16, "inter": 96} if smoke else LLAMA8B
    rank, adapters = 16, 8
    seg = 16 if smoke else 1024
    cases = {  # slots per row: prefill one adapter per request, decode interleaved
        f"prefill {adapters} x {seg}": torch.arange(1, adapters + 1).repeat_interleave(seg),
        "decode 64 rows": torch.arange(64) % adapters + 1,
    }
    if sweep:
        for bs in (1, 8, 16, 32, 128, 256):
            cases[f"decode {bs} rows"] = torch.arange(bs) % adapters + 1
    layer = _lora_layer(dims, rank, adapters, dev)
    print(f"LoRA, one layer's q/k/v, o, gate/up, down at {dims}, rank {rank}, {adapters} adapters")
    best = {}
    for label, slots in cases.items():
        rows = slots.to(dev, torch.int32)
        new, per_token, ys = _lora_fns(layer, rows, rank)
        new_run, old_run = _graphed(new, dev), _graphed(per_token, dev)
        for y in ys["n"] + ys["o"]:
            y.zero_()
        new_run()
        old_run()
        for yn, yo in zip(ys["n"], ys["o"], strict=True):
            err = float((yn.float() - yo.float()).norm() / yo.float().norm())
            assert err < 2e-2, f"{label}: the kernels disagree (relative error {err:.3g})"
        if smoke:
            print(f"{label}: outputs agree (interpreted, not timed)")
            continue
        t_new, t_old = median_ms(new_run, 50), median_ms(old_run, 50)
        print(f"{label}: per-token {t_old * 1e3:.1f} us, segmented {t_new * 1e3:.1f} us "
              f"per layer: {t_old / t_new:.2f}x faster")  # fmt: skip
        if sweep:
            best[rows.shape[0]] = _sweep_lora_tiles(new, ys["n"])
    if write and best:
        write_lora_table(best)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tune-moe", action="store_true", help="tune the fused MoE kernels' tiles")
    p.add_argument("--moe-shape", default="128,768,2048,8", help="experts,inter,hidden,top_k")
    p.add_argument("--moe-tokens", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--fp8", action="store_true", help="FP8 experts (--quantization fp8)")
    p.add_argument("--dry-run", action="store_true", help="print the best tiles, write nothing")
    p.add_argument("--lora", action="store_true", help="LoRA kernels: per-token vs segmented")
    p.add_argument("--smoke", action="store_true", help="--lora at tiny shapes on the CPU")
    p.add_argument("--lora-sweep", action="store_true", help="--lora, then other tiles timed")
    p.add_argument("--write", action="store_true", help="--lora-sweep: write the fastest tiles")
    args = p.parse_args()
    if args.lora or args.lora_sweep:
        import os

        # NOTE: Triton reads it once, before this script's first kernel is defined
        assert not args.smoke or os.environ.get("TRITON_INTERPRET") == "1", "--smoke: set it"
        bench_lora(args.smoke, args.lora_sweep, args.write)
        return
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
