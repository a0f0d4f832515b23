#!/usr/bin/env python
"""GPU benchmark in one run: the device's ceilings, then radixserve and HF transformers on a
random-weight model of a real shape (default: Llama-3.1-8B architecture, bfloat16).

Measured, in order: device-to-device copy GB/s and bf16 matmul TFLOP/s (the ceilings);
radixserve batch-1 decode (128 in / 512 out) against the bandwidth roofline (weight bytes /
copy bandwidth), batched throughput (64 x (1024 in + 256 out)) and a large offline run
(512 x (1024 in + 1024 out)); HF ``generate()`` (eager) at batch 1 and batch 64 on the same
weights. Every system is warmed up at the exact shapes first; rates are output tokens over wall
time, prefill included, EOS ignored.

    python bench/gpu.py --json-out $OUT/gpu.json
    python bench/gpu.py --attention triton,flashinfer  # each backend's rows, then their ratios
    python bench/gpu.py --shape tiny --hardware cpu --attention torch_native --small  # smoke test
    python bench/gpu.py --deterministic ab --skip-hf --skip-big  # deterministic mode off, then on

``--images``: instead, images in (docs/vision.md) on a random-weight Qwen2.5-VL-7B shape
(``--vl-shape``: qwen2-vl-7b or a tiny one; ``--shape tiny``: tiny-qwen2.5-vl): 64 requests of
one 448x448 image (256 image tokens) + 128 text tokens -> 128 output tokens, all submitted at
once; images per second and TTFT p50, first with every image different, then with every
request sending the same image (encoder and prefix cache hits).

    python bench/gpu.py --images --json-out $OUT/vision.json
    python bench/gpu.py --images --shape tiny --hardware cpu --attention torch_native --small
    python bench/gpu.py --images --vl-shape qwen2-vl-7b --json-out $OUT/vision-qwen2-vl.json
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import format_table, machine_info, write_json
from gpu_model import SHAPES, VL_SHAPES, write_random_llama, write_random_qwen2_vl

from radixserve import Engine, hookimpl
from radixserve.core.plugins import PluginHost
from radixserve.plugins.attention import flashinfer as flashinfer_attention
from radixserve.plugins.attention import torch_native
from radixserve.plugins.attention import triton as triton_attention
from radixserve.plugins.grammar import none as grammar_none
from radixserve.plugins.hardware import cpu, cuda
from radixserve.plugins.hicache_storage import file as hicache_file
from radixserve.plugins.hicache_storage import none as hicache_none
from radixserve.plugins.kv_transfer import none as kv_none
from radixserve.plugins.models import gemma2, llama, moe, qwen2, qwen3
from radixserve.plugins.speculative import none as spec_none


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=["llama3-8b", "smollm2", "tiny"])
    add_tuning_flags(p)
    p.add_argument("--repeat-tput", type=int, default=0,
                   help="rerun the batch-64 workload N more times, overlap on and off")  # fmt: skip
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--defaults", action="store_true",
                   help="also run every workload with no tuning flags")  # fmt: skip
    p.add_argument("--tune-decode", action="store_true", help="sweep decode launch settings first")
    p.add_argument("--skip-big", action="store_true", help="skip the 512-request offline run")
    p.add_argument("--small", action="store_true", help="tiny workloads (smoke test)")
    p.add_argument("--workdir", default=None, help="where the model directory is written")
    p.add_argument("--json-out", default=None)
    p.add_argument("--deterministic", choices=("off", "on", "ab"), default="off",
                   help="--enable-deterministic-inference; ab: our workloads without it, then "
                        "with it, and their ratios")  # fmt: skip
    p.add_argument("--dtype", default=None, help="engine dtype (default: the platform's)")
    p.add_argument("--images", action="store_true",
                   help="the vision workload (Qwen2.5-VL-7B shape), not the text ones")  # fmt: skip
    p.add_argument("--vl-shape", choices=sorted(VL_SHAPES), default=None,
                   help="--images' model (default qwen2.5-vl-7b; tiny-qwen2.5-vl with "
                        "--shape tiny)")  # fmt: skip
    return p.parse_args()


def add_tuning_flags(p: argparse.ArgumentParser) -> None:
    """The tuned engine's settings (``tuned_engine``); bench/gpu_serving.py shares them."""
    p.add_argument("--hardware", default="cuda")
    p.add_argument("--attention", default="triton",
                   help="attention plugin(s), comma-separated: each runs in turn")  # fmt: skip
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--quantization", default=None, help="e.g. fp8 (FP8 weights, CUDA)")
    p.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8_e4m3")


def workloads(small: bool) -> dict[str, tuple[int, int, int]]:
    """name -> (requests, input tokens, output tokens)."""
    if small:
        return {"b1": (1, 16, 32), "tput": (8, 64, 16), "big": (16, 64, 32)}
    return {"b1": (1, 128, 512), "tput": (64, 1024, 256), "big": (512, 1024, 1024)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def copy_ms(numel: int) -> float:
    a = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    return median_ms(lambda: b.copy_(a), 20)


def ceilings() -> dict[str, float]:
    copy = copy_ms(1 << 30)  # 2 GiB each way
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: x @ y, 20)
    return {
        "copy_GBps": 2 * (1 << 31) / copy / 1e6,  # bytes read + written
        "matmul_TFLOPs": 2 * n**3 / mm_ms / 1e9,
    }


def workload_bound_tok_s(
    shape: str | dict[str, Any],
    workload: tuple[int, int, int],
    running: int,
    copy_gbps: float,
    tflops: float,
) -> float:
    """Output tok/s if prefill ran at the matmul ceiling and every decode step took the longer
    of reading the weights at the copy ceiling and its matmuls at the matmul ceiling, plus
    reading the running requests' KV at the copy ceiling (no overheads, no overlap). The
    matmul term decides large batches: the 8B shape's 256-row decode step needs 5.2 ms of
    matmul at 745 TFLOP/s against 3.6 ms to read its weights.
    ``shape``: a name in SHAPES or a dense model's config fields (bench/models.py)."""
    c = SHAPES[shape] if isinstance(shape, str) else shape
    n, prompt, out = workload
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q_dim, kv_dim = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    layer_params = 2 * h * q_dim + 2 * h * kv_dim + 3 * h * c["intermediate_size"]
    matmul_params = layers * layer_params + h * c["vocab_size"]  # + the LM head
    weight_bytes = 2 * (matmul_params + (0 if c["tie_word_embeddings"] else h * c["vocab_size"]))
    kv_bytes_per_token = 2 * 2 * layers * kv_dim
    prefill_flops = n * prompt * 2 * matmul_params + n * 2 * layers * q_dim * prompt**2
    prefill_s = prefill_flops / (tflops * 1e12)
    decode_s = 0.0
    for start in range(0, n, running):
        b = min(running, n - start)
        kv_token_reads = b * (out * prompt + out * (out - 1) / 2)
        weights_s = max(out * weight_bytes / (copy_gbps * 1e9),
                        out * b * 2 * matmul_params / (tflops * 1e12))  # fmt: skip
        decode_s += weights_s + kv_token_reads * kv_bytes_per_token / (copy_gbps * 1e9)
    return n * out / (prefill_s + decode_s)


def prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


class StepStats:
    """A plugin that records each step's time (the ``step_finished`` hook)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    @hookimpl
    def step_finished(self, stats: dict[str, Any]) -> None:
        self.steps.append(stats)


def bench_host(stats: StepStats) -> PluginHost:
    # Only the plugins this benchmark needs, imported directly: no install, no entry points.
    mods = [cpu, cuda, torch_native, triton_attention, flashinfer_attention, grammar_none]
    mods += [spec_none, kv_none, hicache_none, hicache_file]
    mods += [llama, qwen2, qwen3, gemma2, moe]
    plugins = [(m.__name__.rsplit(".", 2)[-2] + "_" + m.__name__.rsplit(".", 1)[-1], m)
               for m in mods]  # fmt: skip
    return PluginHost(load_entry_points=False, extra_plugins=[*plugins, ("bench_stats", stats)])


def run_generate(engine: Any, batch: list[list[int]], new: int) -> float:
    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    return timed(lambda: engine.generate(input_ids=batch, sampling_params=params))


def warm_and_time(engine: Any, workload: tuple[int, int, int], vocab: int, seed: int) -> float:
    """Seconds for one workload, after a warm-up over every prefill shape of it (prompts of seed
    ``seed - 1``, outputs cut short): fresh prompts each time, so no run is served from the
    prefix cache of another."""
    n, i, o = workload
    run_generate(engine, prompts(n, i, vocab, seed - 1), max(o // 8, 2))
    return run_generate(engine, prompts(n, i, vocab, seed), o)


def tuned_engine(
    model_dir: Path, args: argparse.Namespace, runs: list[tuple[int, int, int]], host: PluginHost
) -> Any:
    """The engine with our benchmark's tuning flags (``add_tuning_flags``), sized for ``runs``:
    one running slot per request up to --max-running, a KV pool that holds them all."""
    running = min(args.max_running, max(r[0] for r in runs))
    context = max(i + o for _, i, o in runs) + 8
    return Engine(
        str(model_dir), host=host,
        plugins=[f"hardware={args.hardware}", f"attention={args.attention}", "grammar=none"],
        max_running_requests=running, max_total_tokens=running * context + 4096,
        context_length=context, chunked_prefill_size=args.chunked_prefill_size,
        cuda_graph_max_bs=running, disable_cuda_graph=args.disable_cuda_graph,
        disable_overlap_schedule=args.disable_overlap_schedule, page_size=args.page_size,
        enable_deterministic_inference=getattr(args, "deterministic", "off") == "on",
        **({"dtype": args.dtype} if getattr(args, "dtype", None) else {}),
        quantization=getattr(args, "quantization", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
    )  # fmt: skip


def fp8_read_bytes(c: dict[str, Any], bf16_bytes: int) -> int:
    """A batch-1 decode step's weight bytes with --quantization fp8: the decoder layers'
    projections at one byte a weight; the embedding, norms and LM head stay bfloat16."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q_dim, kv_dim = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    layer_params = 2 * h * q_dim + 2 * h * kv_dim + 3 * h * c["intermediate_size"]
    return bf16_bytes - layers * layer_params  # two bytes each -> one


def defaults_engine(model_dir: Path) -> Any:
    """An engine given the model path and no tuning flag: what a user gets by default (the
    hardware platform chooses chunk size, memory, graphs, batch). The grammar plugin is named
    only because this benchmark's host loads no grammar backend."""
    return Engine(str(model_dir), host=bench_host(StepStats()), plugins=["grammar=none"])


def run_ours(model_dir: Path, args: argparse.Namespace, vocab: int, res: dict[str, Any],
             root: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Our engine on every workload; each number is recorded in ``res`` (and ``root``, the
    whole result that ``res`` is part of, saved) as soon as it exists."""

    def note(key: str, value: Any) -> None:
        res[key] = value
        print(f"  {key} = {value}", flush=True)
        if args.json_out:
            write_json(args.json_out, root if root is not None else res)

    w = workloads(args.small)
    runs = [w["b1"], w["tput"]] + ([] if args.skip_big else [w["big"]])
    stats = StepStats()
    start = time.perf_counter()
    engine = tuned_engine(model_dir, args, runs, bench_host(stats))
    runner = engine.core.runner
    note("ours_start_s", time.perf_counter() - start)
    note("plugins", dict(runner.plugins.names))
    note("overlap_schedule", engine.core.overlap)
    note("cuda_graph", hasattr(runner.step, "graphs"))
    n, i, o = w["b1"]
    run_generate(engine, prompts(n, i, vocab, 1), o)  # warm-up at the exact shape
    note("b1_ttft_s", run_generate(engine, prompts(n, i, vocab, 2), 1))
    stats.steps.clear()
    note("b1_s", run_generate(engine, prompts(n, i, vocab, 3), o))
    decode_steps = [s["step_time_s"] for s in stats.steps if s["num_prefill_tokens"] == 0]
    note("b1_step_ms_median", 1e3 * statistics.median(decode_steps))
    note("b1_tok_s", n * o / res["b1_s"])
    note("b1_graph_replay_ms", graph_replay_ms(engine))
    note("b64_empty_graph_replay_ms", graph_replay_ms(engine, 64, 20))  # contexts of 1 token
    if res["cuda_graph"]:  # the same engine with its decode steps run eagerly, for comparison
        graphs, attention, model = runner.step, runner.attention, runner.model
        runner.step = lambda fb: (attention.prepare(fb), model.forward(fb))[1]
        note("b1_eager_tok_s", n * o / run_generate(engine, prompts(n, i, vocab, 7), o))
        runner.step = graphs
    n, i, o = w["tput"]
    note("tput_s", warm_and_time(engine, w["tput"], vocab, 5))
    note("tput_tok_s", n * o / res["tput_s"])
    if engine.core.overlap:  # the same engine, each step finished before the next is scheduled
        engine.core.overlap = False
        n1, i1, o1 = w["b1"]
        note("b1_no_overlap_tok_s", n1 * o1 / run_generate(engine, prompts(n1, i1, vocab, 8), o1))
        stats.steps.clear()
        note("tput_no_overlap_tok_s", n * o / run_generate(engine, prompts(n, i, vocab, 9), o))
        note("tput_step_breakdown", step_breakdown(stats.steps))
        for rep in range(args.repeat_tput):  # alternate the two modes: machine drift cancels
            for overlap in (True, False):
                engine.core.overlap = overlap
                key = "tput_repeat_overlap_tok_s" if overlap else "tput_repeat_no_overlap_tok_s"
                seed = 20 + 2 * rep + overlap
                rate = n * o / run_generate(engine, prompts(n, i, vocab, seed), o)
                note(key, res.get(key, []) + [rate])
        engine.core.overlap = True
    if not args.skip_big:
        n, i, o = w["big"]
        # warmed up at its shapes first, as the other workloads are (and as run_defaults does)
        run_generate(engine, prompts(n, i, vocab, 10), max(o // 8, 2))
        stats.steps.clear()
        note("big_s", run_generate(engine, prompts(n, i, vocab, 6), o))
        note("big_tok_s", n * o / res["big_s"])
        note("big_step_breakdown", step_breakdown(stats.steps))
    engine.shutdown()


def run_defaults(
    model_dir: Path, args: argparse.Namespace, vocab: int, res: dict[str, Any]
) -> None:
    """Every workload again on ``defaults_engine``: what a user gets with no tuning flag."""
    engine = defaults_engine(model_dir)
    res["defaults_settings"] = engine.core.runner.settings.describe()
    print(f"  defaults: {res['defaults_settings']}", flush=True)
    w = workloads(args.small)
    for key, seed in (("b1", 31), ("tput", 33)) + (() if args.skip_big else (("big", 35),)):
        n, i, o = w[key]
        res[f"defaults_{key}_tok_s"] = n * o / warm_and_time(engine, w[key], vocab, seed)
        print(f"  defaults_{key}_tok_s = {res[f'defaults_{key}_tok_s']}", flush=True)
    engine.shutdown()


def step_breakdown(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Host-timed steps split into decode-only steps and steps with prefill tokens (with
    overlap off each includes its GPU time; with it on, a step's time is its share of the run)."""
    decode = [s["step_time_s"] for s in steps if s["num_prefill_tokens"] == 0]
    prefill = [s["step_time_s"] for s in steps if s["num_prefill_tokens"] > 0]
    return {
        "decode_steps": len(decode),
        "decode_total_s": sum(decode),
        "decode_median_ms": 1e3 * statistics.median(decode) if decode else None,
        "prefill_steps": len(prefill),
        "prefill_total_s": sum(prefill),
        "prefill_tokens": sum(s["num_prefill_tokens"] for s in steps),
    }


def graph_replay_ms(engine: Any, bs: int = 1, reps: int = 50) -> float | None:
    """GPU time of one decode step of ``bs`` alone (its captured graph), if graphs are on."""
    graphs = getattr(engine.core.runner.step, "graphs", None)
    return median_ms(graphs[bs][0].replay, reps) if graphs and bs in graphs else None


def run_hf(model_dir: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.hardware == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, device_map=device)
    model.eval()
    w = workloads(args.small)
    out: dict[str, Any] = {}

    def generate(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch, device=device)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            return timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw))

    for key, (n, i, o) in (("hf_b1", w["b1"]), ("hf_b64", w["tput"])):
        generate(prompts(n, i, vocab, 11), o)  # warm-up at the exact shape
        out[f"{key}_s"] = generate(prompts(n, i, vocab, 12), o)
        out[f"{key}_tok_s"] = n * o / out[f"{key}_s"]
    return out


def tune_decode_phase() -> dict[str, Any]:
    from experiments.gpu_kernels import tune_decode  # bench/ is first on sys.path

    best, rows = tune_decode()  # leaves the best settings in place for our engine
    print(f"  decode launch settings: {best}", flush=True)
    return {"decode_config": best, "decode_sweep": rows}


def phase(
    results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]], json_out: str | None
) -> None:
    """Run one phase; a failure is recorded (and printed) and the next phase still runs. The
    JSON is rewritten after every phase, so a run cut short keeps what it measured."""
    start = time.perf_counter()
    try:
        results.update(fn())
    except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
        results[f"{name}_error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] FAILED: {results[f'{name}_error']}", file=sys.stderr, flush=True)
        import traceback

        traceback.print_exc()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"[{name}] {time.perf_counter() - start:.1f}s", flush=True)
    if json_out:
        write_json(json_out, results)


def image_png(size: int, seed: int) -> bytes:
    import io

    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size, size, 3), generator=gen, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, "PNG")
    return buf.getvalue()


def images_pass(engine: Any, prompts_: list[list[int]], images: list[bytes], new: int) -> dict:
    """All requests at once, each streamed from its own thread: wall seconds, TTFT p50."""
    from concurrent.futures import ThreadPoolExecutor

    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    start = time.perf_counter()

    def one(i: int) -> float:
        first = None
        for _ in engine.generate(input_ids=prompts_[i], sampling_params=params,
                                 image_data=[images[i]], stream=True):  # fmt: skip
            first = first or time.perf_counter() - start
        return first or 0.0

    with ThreadPoolExecutor(len(prompts_)) as pool:
        ttfts = list(pool.map(one, range(len(prompts_))))
    wall = time.perf_counter() - start
    n = len(prompts_)
    return {"wall_s": wall, "images_per_s": n / wall, "output_tok_s": n * new / wall,
            "ttft_p50_ms": statistics.median(ttfts) * 1e3}  # fmt: skip


def run_images(args: argparse.Namespace, workdir: Path, res: dict[str, Any]) -> dict[str, Any]:
    """The --images workload (see the module's docstring)."""
    shape = args.vl_shape or ("tiny-qwen2.5-vl" if args.shape == "tiny" else "qwen2.5-vl-7b")
    res["vl_shape"] = shape
    model_dir = workdir / shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res["weight_bytes"] = write_random_qwen2_vl(model_dir, shape, device)
    n, text, new = (4, 16, 8) if args.small else (64, 128, 128)
    stats = StepStats()
    engine = Engine(
        str(model_dir), host=bench_host(stats),
        plugins=[f"hardware={args.hardware}", f"attention={args.attention}", "grammar=none"],
        max_running_requests=n, max_total_tokens=n * (256 + text + new + 8) * 2 + 4096,
        context_length=1024, chunked_prefill_size=args.chunked_prefill_size,
        cuda_graph_max_bs=n, disable_cuda_graph=args.disable_cuda_graph,
        disable_overlap_schedule=args.disable_overlap_schedule, page_size=args.page_size,
    )  # fmt: skip
    vocab = VL_SHAPES[shape]["text"]["vocab_size"]
    rng = random.Random(0)
    out: dict[str, Any] = {}
    try:
        for name, seed in (("warmup", 1000), ("distinct", 0), ("same", None)):
            ps = [
                [vocab - 1] + [rng.randrange(3, vocab - 4) for _ in range(text)] for _ in range(n)
            ]
            same = image_png(448, 7)
            imgs = [same if seed is None else image_png(448, seed + i) for i in range(n)]
            engine.flush_cache()
            out[name] = images_pass(engine, ps, imgs, new)
            out[name]["encoder"] = engine.core.scheduler_counters().get("multimodal")
            print(f"[images {name}] {out[name]}", flush=True)
    finally:
        engine.shutdown()
    out.pop("warmup")
    return {"images": out}


def main() -> None:
    args = parse_args()
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    out = args.json_out
    if args.images:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-gpu-bench-"))
        phase(res, "images", lambda: run_images(args, workdir, res), out)
        if out:
            write_json(out, res)
        return
    if torch.cuda.is_available():
        res["gpu"] = torch.cuda.get_device_name()
        phase(res, "ceilings", ceilings, out)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-gpu-bench-"))
    model_dir = workdir / args.shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    write = lambda: {"weight_bytes": write_random_llama(model_dir, args.shape, device)}
    phase(res, "model", write, out)
    vocab = SHAPES[args.shape]["vocab_size"]
    if not args.skip_hf:  # first: a run cut short by a time limit loses only our last number
        phase(res, "hf", lambda: run_hf(model_dir, args, vocab), out)
    if args.tune_decode:
        phase(res, "tune", tune_decode_phase, out)
    if args.deterministic == "ab":
        deterministic_ab(model_dir, args, vocab, res)
        if out:
            write_json(out, res)
        return
    names = args.attention.split(",")
    graphs_off = args.disable_cuda_graph
    for name in names:  # several: each backend's numbers under res["attention"][name]
        args.attention, args.disable_cuda_graph = name, graphs_off
        mine = res if len(names) == 1 else res.setdefault("attention", {}).setdefault(name, {})
        run = lambda mine=mine: run_ours(model_dir, args, vocab, mine, res) or {}  # noqa: E731
        phase(mine, "ours", run, out)
        if "ours_error" in mine and not args.disable_cuda_graph:
            args.disable_cuda_graph = True  # still measure the kernels, without graphs
            phase(mine, "ours_eager", run, out)
    args.attention, args.disable_cuda_graph = ",".join(names), graphs_off
    if args.defaults:
        phase(res, "defaults", lambda: run_defaults(model_dir, args, vocab, res) or {}, out)
    if len(names) == 1:
        report(res, args)
    else:
        shared = {k: v for k, v in res.items() if k != "attention"}
        for name in names:
            print(f"\nattention={name}")
            view = {**shared, **res["attention"][name]}
            report(view, args)  # adds the roofline and the bounds to view
            res["attention"][name] = {k: v for k, v in view.items() if k not in shared}
        compare_attention(res["attention"], names)
    if out:
        write_json(out, res)


def deterministic_ab(
    model_dir: Path, args: argparse.Namespace, vocab: int, res: dict[str, Any]
) -> None:
    """Our workloads without --enable-deterministic-inference, then with it (one engine each,
    same prompts); the cost is the ratio of the rates (issue: at most 1.3x slower on a GPU)."""
    by_mode: dict[str, dict[str, Any]] = res.setdefault("deterministic", {})
    for mode in ("off", "on"):
        args.deterministic = mode
        mine = by_mode.setdefault(mode, {})
        run = lambda mine=mine: run_ours(model_dir, args, vocab, mine, res) or {}  # noqa: E731
        phase(mine, f"ours_{mode}", run, args.json_out)
    args.deterministic = "ab"
    rows = []
    for key in ("b1_tok_s", "tput_tok_s", "big_tok_s"):
        off, on = by_mode["off"].get(key), by_mode["on"].get(key)
        slower = off / on if off and on else None
        res[f"deterministic_{key}_slowdown"] = slower
        rows.append([key, off, on, slower])
    print(f"\nshape={args.shape} hardware={args.hardware} attention={args.attention}")
    print(format_table(["measure", "off", "deterministic", "off / deterministic"], rows))


def compare_attention(by_name: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Each backend's rate on each workload against the first one named."""
    base = names[0]
    rows = []
    for key in ("b1_tok_s", "tput_tok_s", "big_tok_s", "b1_graph_replay_ms"):
        for name in names:
            value, ref = by_name[name].get(key), by_name[base].get(key)
            rows.append([f"{name} {key}", value, value / ref if value and ref else None,
                         f"/ {base}"])  # fmt: skip
    print(f"\nattention backends against {base}")
    print(format_table(["measure", "value", "ratio", "against"], rows))


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    def ratio(a: str, b: str) -> float | None:
        return r[a] / r[b] if r.get(a) and r.get(b) else None

    w = workloads(args.small)
    if r.get("copy_GBps") and r.get("weight_bytes"):
        r["roofline_b1_tok_s"] = r["copy_GBps"] * 1e9 / r["weight_bytes"]
        if getattr(args, "quantization", None) == "fp8":
            fp8_bytes = fp8_read_bytes(SHAPES[args.shape], r["weight_bytes"])
            r["roofline_fp8_b1_tok_s"] = r["copy_GBps"] * 1e9 / fp8_bytes
        for key in ("tput", "big"):
            running = min(args.max_running, w[key][0])
            r[f"bound_{key}_tok_s"] = workload_bound_tok_s(
                args.shape, w[key], running, r["copy_GBps"], r["matmul_TFLOPs"]
            )
    rows = [
        ["ceiling: copy GB/s", r.get("copy_GBps"), None, None],
        ["ceiling: bf16 matmul TFLOP/s", r.get("matmul_TFLOPs"), None, None],
        ["roofline b1 tok/s (weights / copy bw)", r.get("roofline_b1_tok_s"), None, None],
        [f"ours b1 {w['b1'][1]}/{w['b1'][2]} tok/s", r.get("b1_tok_s"),
         ratio("b1_tok_s", "roofline_b1_tok_s"), ">= 0.75 of roofline"],
        ["FP8 roofline b1 tok/s (fp8 weights / copy bw)", r.get("roofline_fp8_b1_tok_s"),
         ratio("b1_tok_s", "roofline_fp8_b1_tok_s"), "ours / FP8 roofline"],
        ["ours b1 median decode step ms", r.get("b1_step_ms_median"), None, None],
        ["ours b1 graph replay ms (GPU only)", r.get("b1_graph_replay_ms"), None, None],
        ["ours b1 without CUDA graphs tok/s", r.get("b1_eager_tok_s"),
         ratio("b1_eager_tok_s", "roofline_b1_tok_s"), None],
        ["HF generate b1 eager tok/s", r.get("hf_b1_tok_s"), ratio("b1_tok_s", "hf_b1_tok_s"),
         "ours / HF"],
        [f"ours {w['tput'][0]}x({w['tput'][1]}+{w['tput'][2]}) tok/s", r.get("tput_tok_s"),
         ratio("tput_tok_s", "hf_b64_tok_s"), ">= 4x HF b64"],
        ["bound of that workload tok/s (ceilings)", r.get("bound_tput_tok_s"),
         ratio("bound_tput_tok_s", "hf_b64_tok_s"), "bound / HF b64"],
        ["ours / bound", ratio("tput_tok_s", "bound_tput_tok_s"), None, None],
        ["HF generate b64 eager tok/s", r.get("hf_b64_tok_s"), None, None],
        ["ours b1 without overlap tok/s", r.get("b1_no_overlap_tok_s"),
         ratio("b1_tok_s", "b1_no_overlap_tok_s"), "overlap speed-up"],
        ["ours tput without overlap tok/s", r.get("tput_no_overlap_tok_s"),
         ratio("tput_tok_s", "tput_no_overlap_tok_s"), "overlap speed-up"],
        [f"ours {w['big'][0]}x({w['big'][1]}+{w['big'][2]}) tok/s", r.get("big_tok_s"),
         (r["big_tok_s"] / 8000) if r.get("big_tok_s") else None, "/ 8000 target"],
        ["bound of that workload tok/s (ceilings)", r.get("bound_big_tok_s"),
         ratio("big_tok_s", "bound_big_tok_s"), "ours / bound"],
    ] + [[f"no tuning flags: {key} tok/s", r.get(f"defaults_{key}_tok_s"),
          ratio(f"defaults_{key}_tok_s", f"{key}_tok_s"), ">= 0.95 of tuned"]
         for key in ("b1", "tput", "big") if r.get(f"defaults_{key}_tok_s")]  # fmt: skip
    gb = r.get("weight_bytes", 0) / 1e9
    print(f"\nshape={args.shape} gpu={r.get('gpu')} weights={gb:.2f} GB")
    print(format_table(["measure", "value", "ratio", "target"], rows))
    for key in [k for k in r if k.endswith("_error")]:
        print(f"{key}: {r[key]}")


if __name__ == "__main__":
    main()
