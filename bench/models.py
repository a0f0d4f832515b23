#!/usr/bin/env python
"""Issue 20's GPU benchmark in one run: the new model families at real shapes, random bf16 weights.

- Qwen3-8B shape (dense, q/k norm): batch-1 decode (128 in / 512 out) against the roofline (the
  bytes a decode step reads at copy bandwidth) and 512 x (1,024 + 1,024) against its workload
  bound (``gpu.workload_bound_tok_s``).
- Qwen3-30B-A3B shape (128 experts, top-8, fused MoE): batch 1 (128 in / 256 out) against the
  roofline of its active parameters (attention, router, 8 experts, LM head per token) and
  against HF ``generate()``; 64 x (1,024 + 256) against HF, on the same weights.

No weights touch the disk (61 GB for the MoE would not fit the device's disk nor its time): the
model directory holds config.json, a tokenizer and a one-tensor stub checkpoint, and the bench
registers model plugins that build our real classes and fill them on the device: with HF's
tensors where HF ran first (the MoE: HF is built from the config on the GPU, timed, then its
tensors load through our own ``load_weights``, then HF is freed), else random values. Every
number is written to the JSON as soon as it exists.

    python bench/models.py --json-out $OUT/models.json            # the H200 run, ~4 minutes
    python bench/models.py --models tiny-qwen3,tiny-qwen3-moe --small \\
        --hardware cpu --attention torch_native                    # smoke test on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from common import format_table, machine_info, write_json
from gpu import (
    StepStats,
    add_tuning_flags,
    ceilings,
    phase,
    prompts,
    run_generate,
    sync,
    timed,
    tuned_engine,
    warm_and_time,
    workload_bound_tok_s,
)
from gpu_model import _write_tokenizer
from safetensors.torch import save_file

from radixserve import hookimpl
from radixserve.core.plugins import PluginHost
from radixserve.plugins.attention import torch_native
from radixserve.plugins.attention import triton as triton_attention
from radixserve.plugins.grammar import none as grammar_none
from radixserve.plugins.hardware import cpu, cuda
from radixserve.plugins.hicache_storage import none as hicache_none
from radixserve.plugins.kv_transfer import none as kv_none
from radixserve.plugins.models.moe import Qwen3MoeForCausalLM
from radixserve.plugins.models.qwen3 import Qwen3ForCausalLM
from radixserve.plugins.speculative import none as spec_none

_QWEN3 = dict(
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    head_dim=128, tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_MOE = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
GREEDY = 16  # tokens of the greedy comparison with HF on the same weights
#: name -> config.json fields (architectures and model_type included)
MODELS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(
        _QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3, **_MOE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    ),
    "tiny-qwen3": dict(
        _QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    ),
    "tiny-qwen3-moe": dict(
        _QWEN3, **_MOE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32,
    ),
}  # fmt: skip


def is_moe(c: dict[str, Any]) -> bool:
    return bool(c.get("num_experts"))


def workloads(c: dict[str, Any], small: bool) -> dict[str, tuple[int, int, int]]:
    """name -> (requests, input tokens, output tokens): the issue's runs for this kind."""
    if is_moe(c):
        return {"b1": (1, 16, 16), "b64": (4, 32, 8)} if small else {
            "b1": (1, 128, 256), "b64": (64, 1024, 256)}  # fmt: skip
    return {"b1": (1, 16, 32), "big": (8, 32, 16)} if small else {
        "b1": (1, 128, 512), "big": (512, 1024, 1024)}  # fmt: skip


def decode_bytes(c: dict[str, Any]) -> dict[str, int]:
    """bfloat16 bytes of all weights, and of those one batch-1 decode step reads: every matrix
    but the embedding table (one row is read) and, of the experts, the top-k a token picks."""
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    head_dim = c["head_dim"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    attention = 2 * h * q + 2 * h * kv + 2 * head_dim + 2 * h
    if is_moe(c):
        expert = 3 * h * c["moe_intermediate_size"]
        total_mlp = c["num_experts"] * (expert + h)  # experts + router rows
        active_mlp = c["num_experts_per_tok"] * expert + c["num_experts"] * h
    else:
        total_mlp = active_mlp = 3 * h * c["intermediate_size"]
    head = 0 if c["tie_word_embeddings"] else h * vocab
    total = layers * (attention + total_mlp) + h * vocab + head + h
    active = layers * (attention + active_mlp) + h * vocab + h  # the LM head, tied or not
    # --quantization fp8: projections and experts at one byte (router, norms, head at two)
    router = c["num_experts"] * h if is_moe(c) else 0
    linear = layers * (2 * h * q + 2 * h * kv + active_mlp - router)
    return {"weight_bytes": 2 * total, "decode_read_bytes": 2 * active,
            "decode_read_bytes_fp8": 2 * active - linear}  # fmt: skip


def write_model_dir(out: Path, c: dict[str, Any]) -> None:
    """config.json, a tokenizer and a one-tensor checkpoint (the engine needs a safetensors
    file; the bench's model plugins fill the weights)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**c, "torch_dtype": "bfloat16"}, indent=2))
    _write_tokenizer(out, c["vocab_size"])
    save_file({"model.norm.weight": torch.ones(c["hidden_size"])}, str(out / "stub.safetensors"))


class FilledModels:
    """Model plugins for the bench: our Qwen3 and Qwen3-MoE classes whose ``load_weights``
    ignores the stub checkpoint and takes ``source()``'s (HF name, tensor) pairs, or fills
    random values on the device when there is no source."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None

    @hookimpl
    def register_models(self, register) -> None:  # type: ignore[no-untyped-def]
        for cls in (Qwen3ForCausalLM, Qwen3MoeForCausalLM):
            register(cls.__name__, self.factory(cls), description="bench: weights filled")

    def factory(self, cls: type) -> Callable[..., Any]:
        plugin = self

        class Filled(cls):  # type: ignore[misc, valid-type]
            def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
                if plugin.source is not None:
                    return super().load_weights(plugin.source())
                gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(0)
                with torch.no_grad():
                    for p in self.parameters():
                        if p.dim() > 1:
                            p.normal_(0.0, 0.02, generator=gen)
                        else:
                            p.fill_(1.0)
                return None

        return Filled


def bench_host(models: FilledModels, stats: StepStats) -> PluginHost:
    mods = [cpu, cuda, torch_native, triton_attention, grammar_none, spec_none, kv_none,
            hicache_none]
    plugins = [(m.__name__.rsplit(".", 2)[-2] + "_" + m.__name__.rsplit(".", 1)[-1], m)
               for m in mods]  # fmt: skip
    extra = [*plugins, ("bench_filled_models", models), ("bench_stats", stats)]
    return PluginHost(load_entry_points=False, extra_plugins=extra)


def hf_model(model_dir: Path, device: str) -> Any:
    """transformers' model of the config, built on the device with its own random init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def run_hf(model: Any, runs: dict[str, tuple[int, int, int]], vocab: int, note: Any) -> None:
    device = next(model.parameters()).device

    def generate(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch, device=device)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            return timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw))

    for key, (n, i, o) in runs.items():
        generate(prompts(n, i, vocab, 11), 4)  # warm-up at the exact prompt shape
        seconds = generate(prompts(n, i, vocab, 12), o)
        note(f"hf_{key}_tok_s", n * o / seconds)
    ids = torch.tensor(prompts(1, runs["b1"][1], vocab, 13), device=device)
    # no EOS at all: min_new_tokens would mask it, where our ignore_eos only does not stop on it
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=GREEDY, do_sample=False, pad_token_id=0)
    note("hf_greedy", out[0, ids.shape[1] :].tolist())


def run_ours(
    model_dir: Path, args: argparse.Namespace, c: dict[str, Any], models: FilledModels,
    note: Any, note_get: Callable[[str], Any], after_build: Callable[[], None],
) -> None:  # fmt: skip
    runs = workloads(c, args.small)
    stats = StepStats()
    start = time.perf_counter()
    engine = tuned_engine(model_dir, args, list(runs.values()), bench_host(models, stats))
    note("ours_start_s", time.perf_counter() - start)
    after_build()
    runner = engine.core.runner
    note("plugins", dict(runner.plugins.names))
    note("cuda_graph", hasattr(runner.step, "graphs"))
    note("fused_moe", any(getattr(m, "kernels", None) is not None for m in runner.model.modules()))
    vocab = c["vocab_size"]
    n, i, o = runs["b1"]
    run_generate(engine, prompts(n, i, vocab, 1), o)  # warm-up at the exact shape
    stats.steps.clear()
    note("b1_tok_s", n * o / run_generate(engine, prompts(n, i, vocab, 3), o))
    decode = [s["step_time_s"] for s in stats.steps if s["num_prefill_tokens"] == 0]
    note("b1_step_ms_median", 1e3 * statistics.median(decode))
    if "b64" in runs:  # warmed up at its shapes, as bench/gpu.py's batch-64 run
        n, i, o = runs["b64"]
        note("b64_tok_s", n * o / warm_and_time(engine, runs["b64"], vocab, 5))
    if "big" in runs:  # no warm-up (a minute of device time), as bench/gpu.py's big run
        n, i, o = runs["big"]
        note("big_tok_s", n * o / run_generate(engine, prompts(n, i, vocab, 6), o))
    if want := note_get("hf_greedy"):  # the same weights: the same greedy tokens, until
        params = {"temperature": 0, "max_new_tokens": GREEDY, "ignore_eos": True}  # a near-tie
        got = engine.generate(input_ids=prompts(1, runs["b1"][1], vocab, 13)[0],
                              sampling_params=params)["output_ids"]  # fmt: skip
        same = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), GREEDY)
        note("greedy_tokens_equal_to_hf", same)
    engine.shutdown()


def bench_model(name: str, args: argparse.Namespace, res: dict[str, Any]) -> None:
    c = MODELS[name]
    out: dict[str, Any] = res.setdefault(name, {})

    def note(key: str, value: Any) -> None:
        out[key] = value
        print(f"  {name}.{key} = {value}", flush=True)
        if args.json_out:
            write_json(args.json_out, res)

    out.update(decode_bytes(c))
    model_dir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-models-")) / name
    write_model_dir(model_dir, c)
    device = "cuda" if args.hardware == "cuda" else "cpu"
    models, held = FilledModels(), {}  # held: the HF model, until our engine has its weights

    def free_hf() -> None:
        models.source = None
        held.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # HF's generate() caches too

    if is_moe(c) and not args.skip_hf:
        try:
            start = time.perf_counter()
            held["hf"] = hf_model(model_dir, device)
            sync()
            note("hf_build_s", time.perf_counter() - start)
            run_hf(held["hf"], workloads(c, args.small), c["vocab_size"], note)
            models.source = lambda: held["hf"].state_dict().items()  # the same weights
        except Exception as e:  # noqa: BLE001 - recorded; ours still runs on random weights
            note("hf_error", f"{type(e).__name__}: {e}")
            free_hf()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    note("same_weights_as_hf", models.source is not None)
    try:
        run_ours(model_dir, args, c, models, note, out.get, free_hf)
    except Exception as e:
        if args.disable_cuda_graph:
            raise
        note("ours_error", f"{type(e).__name__}: {e}")  # still measure the kernels, eagerly
        free_hf()
        gc.collect()
        eager = argparse.Namespace(**{**vars(args), "disable_cuda_graph": True})
        run_ours(model_dir, eager, c, models, lambda k, v: note(f"eager_{k}", v), out.get, free_hf)


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    rows = [["ceiling: copy GB/s", res.get("copy_GBps"), None, None],
            ["ceiling: bf16 matmul TFLOP/s", res.get("matmul_TFLOPs"), None, None]]  # fmt: skip
    copy, tflops = res.get("copy_GBps"), res.get("matmul_TFLOPs")
    for name in args.models.split(","):
        r, c = res.get(name, {}), MODELS[name]
        runs = workloads(c, args.small)
        if copy and r.get("decode_read_bytes"):
            r["roofline_b1_tok_s"] = copy * 1e9 / r["decode_read_bytes"]
            if args.quantization == "fp8":
                r["roofline_fp8_b1_tok_s"] = copy * 1e9 / r["decode_read_bytes_fp8"]
        if copy and tflops and "big" in runs:
            running = min(args.max_running, runs["big"][0])
            r["bound_big_tok_s"] = workload_bound_tok_s(c, runs["big"], running, copy, tflops)

        def ratio(a: str, b: str, r: dict[str, Any] = r) -> float | None:
            return r[a] / r[b] if r.get(a) and r.get(b) else None

        n, i, o = runs["b1"]
        rows += [
            [f"{name}: weights GB / read per b1 step GB", r.get("weight_bytes", 0) / 1e9,
             r.get("decode_read_bytes", 0) / 1e9, None],
            [f"{name}: roofline b1 tok/s", r.get("roofline_b1_tok_s"), None, None],
            [f"{name}: ours b1 {i}/{o} tok/s", r.get("b1_tok_s"),
             ratio("b1_tok_s", "roofline_b1_tok_s"), "/ roofline"],
            [f"{name}: ours b1 median decode step ms", r.get("b1_step_ms_median"), None, None],
            [f"{name}: FP8 roofline b1 tok/s", r.get("roofline_fp8_b1_tok_s"),
             ratio("b1_tok_s", "roofline_fp8_b1_tok_s"), "/ FP8 roofline"],
        ]  # fmt: skip
        if "big" in runs:
            n, i, o = runs["big"]
            rows += [
                [f"{name}: ours {n}x({i}+{o}) tok/s", r.get("big_tok_s"),
                 ratio("big_tok_s", "bound_big_tok_s"), "/ workload bound"],
                [f"{name}: workload bound tok/s", r.get("bound_big_tok_s"), None, None],
            ]  # fmt: skip
        if "b64" in runs:
            n, i, o = runs["b64"]
            rows += [
                [f"{name}: HF generate b1 tok/s", r.get("hf_b1_tok_s"),
                 ratio("b1_tok_s", "hf_b1_tok_s"), "ours / HF"],
                [f"{name}: ours {n}x({i}+{o}) tok/s", r.get("b64_tok_s"), None, None],
                [f"{name}: HF generate {n}x({i}+{o}) tok/s", r.get("hf_b64_tok_s"),
                 ratio("b64_tok_s", "hf_b64_tok_s"), "ours / HF"],
            ]  # fmt: skip
    print(f"\ngpu={res.get('gpu')}")
    print(format_table(["measure", "value", "ratio", "meaning"], rows))
    for name in args.models.split(","):
        for key in [k for k in res.get(name, {}) if k.endswith("_error")]:
            print(f"{name}.{key}: {res[name][key]}")
    for key in [k for k in res if k.endswith("_error")]:
        print(f"{key}: {res[key]}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-8b,qwen3-30b-a3b",
                   help=f"comma-separated, of: {', '.join(MODELS)}")  # fmt: skip
    add_tuning_flags(p)
    p.add_argument("--skip-hf", action="store_true", help="no HF generate() (MoE: random weights)")
    p.add_argument("--small", action="store_true", help="tiny workloads (smoke test)")
    p.add_argument("--workdir", default=None, help="where the model directories are written")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if unknown := [m for m in args.models.split(",") if m not in MODELS]:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    return args


def main() -> None:
    args = parse_args()
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    if torch.cuda.is_available():
        res["gpu"] = torch.cuda.get_device_name()
        phase(res, "ceilings", ceilings, args.json_out)
    for name in args.models.split(","):
        phase(res, name, lambda name=name: bench_model(name, args, res) or {}, args.json_out)
    report(res, args)
    if args.json_out:
        write_json(args.json_out, res)


if __name__ == "__main__":
    main()
