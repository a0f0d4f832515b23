#!/usr/bin/env python
"""Decode layers at batch 64 with the 8B shape (issue 18): does the attention kernel go faster
with another launch order or eviction policy, and does the step go faster when that kernel asks
L2 to fetch and keep the next product's weight (o_proj's, 32 MB) while it streams KV?

The decode profile put o_proj at 0.65 and qkv at 0.70 of copy bandwidth at 64 rows (few tiles
for 132 multiprocessors, whatever the kernel), and attention at ~0.83 (docs/BENCHMARKS.md): the
bandwidth attention leaves unused can bring o_proj's weight into L2 for free. Each variant runs
LAYERS decoder layers (qkv -> decode attention -> o -> add+RMSNorm -> gate_up -> SiLU*up ->
down -> add+RMSNorm) over their own weights and KV (KV in the engine's slot layout at the
workload's mean context), replayed in a CUDA graph; ratios are against weights + KV read at
the copy ceiling measured in the same run. Outputs must equal the base variant's bit for bit
(none of the switches changes arithmetic).

    python bench/l2_prefetch.py --json-out l2-prefetch.json
"""

from __future__ import annotations

import argparse
from typing import Any

import gpu
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import format_table, write_json
from decode_sweep import BATCH, DIM, HEADS, KV_HEADS, PROMPT
from tp_micro import graph_us  # bench/ is the script's own folder, first on sys.path

from radixserve.plugins.attention.triton import decode_kernel as dk
from radixserve.plugins.attention.triton.attend import prefetch_l2
from radixserve.plugins.models import fused_ops

HIDDEN, INTER = 4096, 14336
CTX = 1168  # the 64 x (1,024 + 256) run's mean context
LAYERS = 8

#: name -> (decode config over GPU_CONFIG, what is prefetched: None, "o", "qkv_next", "side_o")
VARIANTS: dict[str, tuple[dict[str, int], str | None]] = {
    "base": ({}, None),
    "kv_major": ({"kv_major": 1}, None),
    "evict_first": ({"evict_first": 1}, None),
    "stages2": ({"num_stages": 2}, None),
    "prefetch_o": ({}, "o"),
    "prefetch_o+evict": ({"evict_first": 1}, "o"),
    "prefetch_o+evict+major": ({"evict_first": 1, "kv_major": 1}, "o"),
    "prefetch_o+evict+stages2": ({"evict_first": 1, "num_stages": 2}, "o"),
    "side_stream_o+evict": ({"evict_first": 1}, "side_o"),
    "prefetch_qkv_next+evict": ({"evict_first": 1}, "qkv_next"),
}


@triton.jit
def _read_kernel(X, Sink, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0)
    tl.store(Sink + tl.program_id(0), tl.sum(x, 0))


@triton.jit
def _prefetch_kernel(addr, lines, BLOCK: tl.constexpr):
    prefetch_l2(addr, lines, tl.program_id(0), tl.num_programs(0), BLOCK)


def ceilings() -> dict[str, float]:
    """GB/s: bench/gpu.py's copy ceiling (read + write counted) and a 4 GB read."""
    copy_gbps = gpu.ceilings()["copy_GBps"]
    x = torch.ones(1 << 31, dtype=torch.int16, device="cuda")
    block = 8192
    sink = torch.empty(triton.cdiv(x.numel(), block), dtype=torch.int32, device="cuda")
    read_us = graph_us(lambda: _read_kernel[(sink.numel(),)](x, sink, x.numel(), BLOCK=block), 10)
    return {"copy_gbps": copy_gbps, "read_gbps": x.nbytes / read_us / 1e3}


def kv_case(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One layer's K/V pool and the batch's table (decode_sweep.make_case's layout)."""
    slots = 1 + BATCH * (PROMPT + 256)
    shape = (slots, KV_HEADS, DIM)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    return {"k": k, "v": v}


def table() -> torch.Tensor:
    i = torch.arange(BATCH, device="cuda")[:, None]
    pos = torch.arange(CTX, device="cuda")[None, :]
    prompt = 1 + i * PROMPT + pos
    decoded = 1 + BATCH * PROMPT + (pos - PROMPT) * BATCH + i
    return torch.where(pos < PROMPT, prompt, decoded).to(torch.int32).contiguous()


def weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)

    q_size, kv = HEADS * DIM, KV_HEADS * DIM
    return {"qkv": w(q_size + 2 * kv, HIDDEN), "o": w(HIDDEN, q_size),
            "gate_up": w(2 * INTER, HIDDEN), "down": w(HIDDEN, INTER)}  # fmt: skip


def build(variant: str, state: dict[str, Any]) -> Any:
    overrides, what = VARIANTS[variant]
    config = {**dk.GPU_CONFIG, **overrides}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = dk.num_decode_splits(BATCH, KV_HEADS, sms, config)
    po = torch.empty(BATCH, HEADS, splits, DIM, device="cuda")
    pl = torch.empty(BATCH, HEADS, splits, device="cuda")
    counters = dk.new_counters(BATCH, KV_HEADS, torch.device("cuda"))
    out = torch.empty(BATCH, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    ws, kvs, norm = state["weights"], state["kv"], state["norm"]
    result: dict[str, torch.Tensor] = {}

    def once() -> None:
        x, res = state["x"], state["res"]
        for layer in range(LAYERS):
            w, kv = ws[layer], kvs[layer]
            qkv = F.linear(x, w["qkv"])
            q = qkv[:, : HEADS * DIM].view(BATCH, HEADS, DIM)
            prefetch = None
            if what == "o":
                prefetch = w["o"]
            elif what == "qkv_next":
                prefetch = ws[(layer + 1) % LAYERS]["qkv"]
            if what == "side_o":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    lines = w["o"].nbytes // 128
                    _prefetch_kernel[(sms * 4,)](w["o"].data_ptr(), lines, BLOCK=128)
            dk.decode_attention(q, kv["k"], kv["v"], state["table"], state["rows"],
                                state["lens"], out, po, pl, DIM**-0.5, counters=counters,
                                config=config, prefetch=prefetch)  # fmt: skip
            if what == "side_o":
                torch.cuda.current_stream().wait_stream(side)
            o = F.linear(out.view(BATCH, HEADS * DIM), w["o"])
            h, res = fused_ops.add_rms_norm(o, res, norm, 1e-5)
            act = fused_ops.silu_mul(F.linear(h, w["gate_up"]))
            x, res = fused_ops.add_rms_norm(F.linear(act, w["down"]), res, norm, 1e-5)
        result["x"] = x

    return once, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json-out", default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")  # the engine's CUDA default
    gen = torch.Generator(device="cuda").manual_seed(0)
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s, read {ceil['read_gbps']:.0f} GB/s",
          flush=True)  # fmt: skip
    state: dict[str, Any] = {
        "weights": [weights(gen) for _ in range(LAYERS)],
        "kv": [kv_case(gen) for _ in range(LAYERS)],
        "table": table(),
        "rows": torch.arange(BATCH, device="cuda", dtype=torch.int32),
        "lens": torch.full((BATCH,), CTX, device="cuda", dtype=torch.int32),
        "norm": torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
        "x": torch.randn(BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen),
        "res": torch.randn(BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen),
    }
    layer_bytes = sum(t.nbytes for t in state["weights"][0].values())
    layer_bytes += 2 * BATCH * CTX * KV_HEADS * DIM * 2
    bound_us = layer_bytes / ceil["copy_gbps"] / 1e3
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    ref = None
    for rnd in range(args.rounds):
        for variant in args.variants:
            once, result = build(variant, state)
            once()
            torch.cuda.synchronize()
            if ref is None:
                ref = result["x"].clone()
            same = torch.equal(result["x"], ref)
            us = graph_us(once, 20) / LAYERS
            times[variant].append(us)
            print(f"round {rnd} {variant}: {us:.1f} us a layer, same output: {same}", flush=True)
            if not same:
                times[variant].append(float("inf"))
    base = min(times["base"]) if "base" in times else None
    rows = []
    for variant, ts in times.items():
        best = min(ts)
        rows.append([variant, *(round(t, 1) for t in ts), round(best, 1),
                     round(bound_us / best, 3), round(base / best, 3) if base else ""])  # fmt: skip
    head = ["variant", *(f"round {r} us" for r in range(args.rounds)), "best us",
            "bound / best", "base / best"]  # fmt: skip
    print(format_table(head, rows))
    print(f"bound a layer (weights {layer_bytes / 1e6:.0f} MB incl. KV, at copy bw): "
          f"{bound_us:.1f} us")  # fmt: skip
    if args.json_out:
        write_json(args.json_out, {"ceilings": ceil, "bound_us": bound_us, "head": head,
                                   "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
