#!/usr/bin/env python
"""What the CPU fast mode gives up: greedy agreement and perplexity of radixserve's default mode
(a GGUF model: its Q4_1 blocks, float16 KV, compiled decode) against the exact mode (``--dtype
float32``), float32 transformers and llama.cpp on the same GGUF file (issue 58).

- Greedy agreement: ``--prompts`` chat prompts, ``--new-tokens`` each; per pair of systems, the
  outputs that are identical and the mean common prefix in tokens.
- Perplexity: the repository's own prose (README.md and docs/*.md, tokenized, cut into
  ``--chunks`` windows of ``--window`` tokens); each system scores every token of a window
  given the ones before it (teacher forcing). The exact mode's should equal transformers'.

llama.cpp runs in its own venv (``peers/llama``, see bench/cpu_peers.py) as a child process.

    .venv/bin/python bench/experiments/cpu_quality.py --json-out bench/results/cpu-quality.json

``--gpu-fp8`` (a CUDA machine): the same measures for FP8 on the GPU, each against bfloat16
(the default model converted to an HF directory, or ``--model-dir``): ``--quantization fp8``,
``--kv-cache-dtype fp8_e4m3``, and both; the issue's run is 64 prompts x 64 tokens:

    python bench/experiments/cpu_quality.py --gpu-fp8 --prompts 64 --new-tokens 64 \
        --json-out $OUT/fp8-quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a short poem about the sea.",
    "What does a compiler do?",
]
#: what turns the 8 prompts into more (``--prompts`` up to 64)
VARIANTS = ["", " Answer briefly.", " Explain it to a child.", " Be precise.", " Use a list.",
            " Start with a summary.", " Give an example.", " Answer in detail."]  # fmt: skip


def prompt_texts(n: int) -> list[str]:
    """n prompts: each of PROMPTS with each of VARIANTS in turn (64 at most)."""
    return [PROMPTS[i % len(PROMPTS)] + VARIANTS[i // len(PROMPTS)] for i in range(n)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--llama-python", default=str(ROOT / "peers/llama/bin/python"))
    p.add_argument("--json-out", default=None)
    p.add_argument("--gpu-fp8", action="store_true", help="FP8 against bfloat16 on a CUDA GPU")
    p.add_argument("--model-dir", default=None, help="--gpu-fp8: an HF model directory")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def _nll(logprobs: list[float]) -> dict[str, float]:
    return {"tokens": len(logprobs), "ppl": math.exp(-statistics.fmean(logprobs))}


def _greedy_and_nll(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """One engine's greedy outputs on the prompts and its perplexity over the windows."""
    greedy = {"temperature": 0.0, "max_new_tokens": spec["new_tokens"], "ignore_eos": True}
    outs = engine.generate(input_ids=spec["prompts"], sampling_params=greedy)
    scored = engine.generate(
        input_ids=spec["windows"],
        sampling_params={"temperature": 0.0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )
    logprobs = [e[0] for o in scored for e in o["meta_info"]["input_token_logprobs"][1:]]
    return {"greedy": [o["output_ids"] for o in outs], **_nll(logprobs)}


def run_ours(spec: dict[str, Any], exact: bool) -> dict[str, Any]:
    from radixserve import Engine

    os.environ.pop("RADIXSERVE_CPU_MODE", None)
    settings = {"dtype": "float32"} if exact else {}
    with Engine(model_path=spec["gguf"], **settings) as engine:
        return _greedy_and_nll(engine, spec)


def run_gpu(spec: dict[str, Any], settings: dict[str, str]) -> dict[str, Any]:
    """Ours on the GPU from the HF directory, bfloat16 with ``settings`` (FP8 ones)."""
    from radixserve import Engine

    with Engine(model_path=spec["hf_dir"], plugins=["hardware=cuda"], dtype="bfloat16",
                **settings) as engine:  # fmt: skip
        return _greedy_and_nll(engine, spec)


GPU_RUNS = {
    "bf16": {},
    "fp8 weights": {"quantization": "fp8"},
    "fp8 KV": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8 weights + fp8 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
}


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
    greedy, logprobs = [], []
    with torch.inference_mode():
        for prompt in spec["prompts"]:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=spec["new_tokens"],
                                 min_new_tokens=spec["new_tokens"], pad_token_id=0)  # fmt: skip
            greedy.append(out[0, ids.shape[1] :].tolist())
        for window in spec["windows"]:
            ids = torch.tensor([window])
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            logprobs += lp.gather(1, ids[0, 1:, None])[:, 0].tolist()
    return {"greedy": greedy, **_nll(logprobs)}


def run_llamacpp(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from llama_cpp import Llama

    n_ctx = max(spec["window"], max(map(len, spec["prompts"])) + spec["new_tokens"]) + 8
    llm = Llama(model_path=spec["gguf"], n_ctx=n_ctx, logits_all=True, verbose=False)
    greedy = []
    for prompt in spec["prompts"]:
        llm.reset()
        out: list[int] = []
        for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) == spec["new_tokens"]:
                break
        greedy.append(out)
    logprobs: list[float] = []
    for window in spec["windows"]:
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        logits -= logits.max(-1, keepdims=True)
        lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        logprobs += [float(lp[i, t]) for i, t in enumerate(window[1:])]
    return {"greedy": greedy, **_nll(logprobs)}


def make_spec(args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from radixserve.plugins.models.gguf_loader import (
        convert_gguf_to_hf_dir,
        default_model_gguf_path,
    )

    if args.model_dir:
        gguf, hf_dir = "", Path(args.model_dir)
    else:
        gguf = str(default_model_gguf_path())
        hf_dir = convert_gguf_to_hf_dir(gguf, progress=True)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    template = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    prompts = [tok.encode(template.format(p)).ids for p in prompt_texts(args.prompts)]
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))])
    ids = tok.encode(text).ids
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) == args.window][: args.chunks]
    return {"gguf": gguf, "hf_dir": str(hf_dir), "prompts": prompts, "windows": windows,
            "new_tokens": args.new_tokens, "window": args.window}  # fmt: skip


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    def prefix(x: list[int], y: list[int]) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    pairs = list(zip(a, b, strict=True))
    same = sum(x == y for x, y in pairs)
    mean = statistics.fmean(prefix(x, y) for x, y in pairs)
    return f"{same}/{len(pairs)} identical, mean common prefix {mean:.1f}"


def main() -> None:
    args = parse_args()
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        result = run_llamacpp(spec) if args.worker == "llamacpp" else run_hf(spec)
        Path(args.out).write_text(json.dumps(result))
        return
    spec = make_spec(args)
    results: dict[str, Any] = {}
    if args.gpu_fp8:
        for name, settings in GPU_RUNS.items():
            results[name] = run_gpu(spec, settings)
        report(results, spec, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for name, python in (("transformers-f32", sys.executable), ("llamacpp", args.llama_python)):
            out = Path(tmp) / f"{name}.json"
            worker = "llamacpp" if name == "llamacpp" else "hf"
            if not Path(python).exists():
                print(f"{name}: not run ({python} missing)")
                continue
            env = {**os.environ, **({"PYTHONPATH": ""} if worker == "llamacpp" else {})}
            cmd = [
                python,
                __file__,
                "--worker",
                worker,
                "--spec",
                str(spec_path),
                "--out",
                str(out),
            ]
            if subprocess.run(cmd, env=env).returncode == 0:
                results[name] = json.loads(out.read_text())
    results["ours-exact (--dtype float32)"] = run_ours(spec, exact=True)
    results["ours-default (fast mode)"] = run_ours(spec, exact=False)
    report(results, spec, args)


def report(results: dict[str, Any], spec: dict[str, Any], args: argparse.Namespace) -> None:
    tokens = next(iter(results.values()))["tokens"]
    print(
        f"\nperplexity on {tokens} tokens of the repository's docs "
        f"({args.chunks} windows of {args.window}):"
    )
    for name, r in results.items():
        print(f"  {name:30} {r['ppl']:.3f}")
    print(f"\ngreedy agreement, {len(spec['prompts'])} chat prompts x {args.new_tokens} tokens:")
    names = list(results)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            print(f"  {a} vs {b}: {agreement(results[a]['greedy'], results[b]['greedy'])}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
