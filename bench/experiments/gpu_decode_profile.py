#!/usr/bin/env python
"""Where a large decode step's time goes, against its bound (issue 18), on CUDA.

For each attention backend and batch size: ``batch`` requests of ``--context`` cached prompt
tokens decode ``--steps`` tokens with the tuned engine of bench/gpu.py (CUDA graphs, overlap
on). The step's wall time (host-timed decode-only steps), the GPU time of its kernels by kind
(torch.profiler over a second, identical run; kernels inside CUDA graphs are traced too) and
the bound (weights + the running requests' KV read once at the measured copy bandwidth) are
printed side by side, so the table says whether the loss is in a kind of kernel or between
kernels.

    python bench/gpu_decode_profile.py --attention triton flashinfer --batches 64 256
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from common import format_table, machine_info, write_json
from gpu import (
    StepStats,
    add_tuning_flags,
    bench_host,
    ceilings,
    prompts,
    run_generate,
    tuned_engine,
)
from gpu_model import SHAPES, write_random_llama

# First match wins: kernel names of cuBLAS/CUTLASS, our Triton kernels, FlashInfer, torch.
KINDS = [
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|splitk|sm90_|_mm_|mm_kernel"),
    ("attention", r"decode|attn|attention|flashinfer|batchprefill|prefill|merge_state"),
    ("kv store", r"store_kv|kv_store|index_copy|scatter|append_paged|set_kv"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|act_and_mul|swiglu|gelu"),
    ("sampling", r"argmax|sampl|softmax|topk|sort|max_kernel|reduce"),
    ("copy / fill", r"memcpy|memset|copy|fill|cat_|catarray"),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, default=1536, help="cached prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="decode steps per run")
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--workdir", default=None)
    p.add_argument("--json-out", default=None)
    add_tuning_flags(p)
    return p.parse_args()


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pat in KINDS if re.search(pat, low)), "other")


def kernel_ms_by_kind(prof: Any) -> tuple[dict[str, float], dict[str, float]]:
    """GPU ms of every device event, by kind and by kernel name."""
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = e.time_range.elapsed_us() / 1e3
        by_kind[kind_of(e.name)] += ms
        by_name[e.name] += ms
    return dict(by_kind), dict(by_name)


def bound_ms(shape: dict[str, Any], batch: int, context: float, copy_gbps: float) -> dict:
    """Weights and KV read once per decode step at the copy bandwidth (bench/gpu.py's bound)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    q_dim, kv_dim = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    params = layers * (2 * h * q_dim + 2 * h * kv_dim + 3 * h * shape["intermediate_size"])
    params += h * shape["vocab_size"]
    kv_bytes = batch * context * 2 * 2 * layers * kv_dim
    to_ms = 1e3 / (copy_gbps * 1e9)
    return {"weights": 2 * params * to_ms, "kv": kv_bytes * to_ms}


def profile_one(engine: Any, stats: StepStats, args: argparse.Namespace, batch: int,
                vocab: int, copy_gbps: float) -> dict[str, Any]:  # fmt: skip
    ps = prompts(batch, args.context, vocab, seed=batch)
    run_generate(engine, ps, 2)  # prefill; later runs find the prompts cached
    run_generate(engine, ps, args.steps)  # warm-up at these lengths
    stats.steps.clear()
    seconds = run_generate(engine, ps, args.steps)
    decode = [s["step_time_s"] for s in stats.steps if s["num_prefill_tokens"] == 0]
    steps_run = len(stats.steps)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run_generate(engine, ps, args.steps)
    by_kind, by_name = kernel_ms_by_kind(prof)
    per_step = {k: v / steps_run for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    bound = bound_ms(SHAPES[args.shape], batch, args.context + args.steps / 2, copy_gbps)
    return {
        "batch": batch,
        "run_s": seconds,
        "steps": steps_run,
        "decode_step_median_ms": 1e3 * statistics.median(decode) if decode else None,
        "kernel_ms_per_step": per_step,
        "kernel_total_ms_per_step": sum(per_step.values()),
        "bound_ms": bound,
        "top_kernels_ms_per_step": [(n[:90], v / steps_run) for n, v in top],
    }


def main() -> int:
    args = parse_args()
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    cuda = torch.cuda.is_available()  # without: a smoke test of this script (--hardware cpu)
    res["gpu"] = torch.cuda.get_device_name() if cuda else None
    res["ceilings"] = ceil = ceilings() if cuda else {"copy_GBps": 10.0}
    print(f"ceilings: {ceil}", flush=True)
    model_dir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-prof-")) / args.shape
    if not (model_dir / "config.json").exists():
        write_random_llama(model_dir, args.shape, "cpu")
    vocab = SHAPES[args.shape]["vocab_size"]
    runs = [(max(args.batches), args.context, args.steps + 8)]
    rows: list[list[Any]] = []
    for backend in args.backends:
        args.attention = backend
        stats = StepStats()
        engine = tuned_engine(model_dir, args, runs, bench_host(stats))
        try:
            for batch in args.batches:
                r = profile_one(engine, stats, args, batch, vocab, ceil["copy_GBps"])
                res[f"{backend}_b{batch}"] = r
                b = r["bound_ms"]
                kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["kernel_ms_per_step"].items())
                rows.append([backend, batch, r["decode_step_median_ms"],
                             r["kernel_total_ms_per_step"], b["weights"] + b["kv"],
                             f"weights {b['weights']:.2f} + KV {b['kv']:.2f}", kinds])  # fmt: skip
                print(f"{backend} b{batch}: {r}", flush=True)
        finally:
            engine.shutdown()
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print(format_table(["backend", "batch", "step ms (wall)", "kernels ms", "bound ms",
                        "bound parts", "kernel ms per step by kind"], rows))  # fmt: skip
    if args.json_out:
        write_json(args.json_out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
