#!/usr/bin/env python
"""Multi-LoRA throughput: requests spread over N random adapters against the base model alone,
in one run of one Engine (started with --enable-lora, N adapter slots).

Adapters are random PEFT directories (rank ``--rank``, all seven projections, written here
without peft). Each phase submits every request at once and counts output tokens / wall time
(prefill included), after a warm-up of both phases with short outputs: (a) the base model for
every request, (b) request i under adapter i mod N; ``--rounds`` repeats the pair and takes
medians. The ratio mixed / base is printed; the GPU target is >= 0.8.

    CPU (SmolLM2, the bundled model):
      .venv/bin/python bench/lora.py --json-out bench/results/lora-cpu.json
    H200 (Llama-3-8B shape, random weights, bfloat16, the issue's workload):
      python bench/lora.py --device cuda --shape llama3-8b --num-requests 64 \
          --input-len 1024 --output-len 256 --rank 16 --num-adapters 8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from common import format_table, machine_info, random_prompts, special_token_ids, write_json
from safetensors.torch import save_file

from radixserve import Engine

MODULES = {  # PEFT module -> (block, in features, out features) from the config
    "q_proj": ("self_attn", "h", "q"), "k_proj": ("self_attn", "h", "kv"),
    "v_proj": ("self_attn", "h", "kv"), "o_proj": ("self_attn", "q", "h"),
    "gate_proj": ("mlp", "h", "i"), "up_proj": ("mlp", "h", "i"), "down_proj": ("mlp", "i", "h"),
}  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model-path", help="model directory (default: SmolLM2 on the CPU)")
    p.add_argument("--shape", help="random weights of bench/gpu_model.py's SHAPES (e.g. llama3-8b)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1, help="base then mixed, this many times")
    p.add_argument("--json-out")
    return p.parse_args(argv)


def write_adapter(out: Path, config: dict[str, Any], rank: int, seed: int) -> Path:
    """A random PEFT LoRA directory for every layer's seven projections."""
    g = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    size = {"h": h, "q": config["num_attention_heads"] * d, "i": config["intermediate_size"],
            "kv": config["num_key_value_heads"] * d}  # fmt: skip
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (block, fan_in, fan_out) in MODULES.items():
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            a = torch.randn(rank, size[fan_in], generator=g) / size[fan_in] ** 0.5
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            b = torch.randn(size[fan_out], rank, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def model_dir(args: argparse.Namespace, work: Path) -> Path:
    if args.shape is not None:
        from gpu_model import write_random_llama

        write_random_llama(work / args.shape, args.shape, args.device)
        return work / args.shape
    if args.model_path is not None:
        return Path(args.model_path)
    from radixserve.plugins.models.gguf_loader import (
        convert_gguf_to_hf_dir,
        default_model_gguf_path,
    )

    return convert_gguf_to_hf_dir(default_model_gguf_path())


def timed(
    engine: Engine, prompts: list[list[int]], loras: list[str | None], n: int
) -> tuple[float, float]:
    """Output tokens per second of wall time and per second of this process's CPU time (all
    its threads: on a machine other jobs load, the steadier of the two)."""
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    start, cpu = time.perf_counter(), time.process_time()
    out = engine.generate(input_ids=prompts, sampling_params=params, lora_path=loras)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert all(len(o["output_ids"]) == n for o in out)
    return len(prompts) * n / seconds, len(prompts) * n / cpu


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = model_dir(args, work)
        config = json.loads((path / "config.json").read_text())
        names = [f"lora{i}" for i in range(args.num_adapters)]
        paths = [
            f"{n}={write_adapter(work / n, config, args.rank, i)}" for i, n in enumerate(names)
        ]
        prompts = random_prompts(args.num_requests, args.input_len, config["vocab_size"],
                                 special_token_ids(path), seed=0)  # fmt: skip
        hardware = "cuda" if args.device == "cuda" else "cpu"
        settings: dict[str, Any] = {"dtype": "bfloat16" if args.device == "cuda" else "float32"}
        with Engine(str(path), plugins={"hardware": hardware}, lora_paths=paths,
                    max_loras_per_batch=args.num_adapters, max_lora_rank=args.rank,
                    **settings) as engine:  # fmt: skip
            mixed = [names[i % len(names)] for i in range(len(prompts))]
            phases = {"base": [None] * len(prompts), "mixed": mixed}
            for loras in phases.values():  # warm-up: every prefill and kernel shape once
                engine.flush_cache()
                timed(engine, prompts, loras, 8)
            runs: dict[str, list[tuple[float, float]]] = {label: [] for label in phases}
            for _ in range(args.rounds):  # base, mixed, base, mixed, ...
                for label, loras in phases.items():
                    engine.flush_cache()  # every phase computes its prompts
                    runs[label].append(timed(engine, prompts, loras, args.output_len))
    rates = {k: statistics.median(r for r, _ in v) for k, v in runs.items()}
    cpu_rates = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    ratio = rates["mixed"] / rates["base"]
    cpu_ratio = cpu_rates["mixed"] / cpu_rates["base"]
    rows = [[k, f"{v:.1f}", f"{cpu_rates[k]:.1f}"] for k, v in rates.items()]
    print(format_table(["phase", "output tok/s", "tok per CPU s"], rows))
    if args.rounds > 1:
        for k, v in runs.items():
            print(f"{k}, each round: " + ", ".join(f"{r:.1f}" for r, _ in v) + " tok/s")
    print(f"mixed over {args.num_adapters} adapters / base alone: {ratio:.4f}x "
          f"(per CPU second: {cpu_ratio:.2f}x; medians of {args.rounds} rounds)")  # fmt: skip
    if args.json_out:
        write_json(args.json_out, {"args": vars(args), "rates": rates, "ratio": ratio,
                                   "cpu_rates": cpu_rates, "cpu_ratio": cpu_ratio, "runs": runs,
                                   "machine": machine_info()})  # fmt: skip


if __name__ == "__main__":
    main()
