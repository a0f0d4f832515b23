#!/usr/bin/env python
"""Offline throughput on CPU: radixserve's Engine against its peers, in one run.

The workload: ``--num-requests`` prompts of ``--input-len`` random token ids (seeded, no special
tokens), each generating exactly ``--output-len`` tokens greedily (EOS ignored). Measured:

  (a) radixserve ``Engine``, every request submitted at once (continuous batching);
  (b) HF transformers ``generate()`` on the same converted weights (float32), batch 1 and 8;
  (c) llama-cpp-python on the GGUF file the weights come from, batch 1.

Each rate is output tokens / wall time (prefill included), after a warm-up run. HF and llama.cpp
run fewer requests by default to bound the runtime; a rate stays comparable.

    .venv/bin/python bench/offline.py --json-out bench/results/offline-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import (
    RateResult,
    batched,
    default_gguf_path,
    format_table,
    machine_info,
    num_cores,
    random_prompts,
    special_token_ids,
    write_json,
)
from tqdm import tqdm

from radixserve import Engine, hookimpl
from radixserve.core.plugins import PluginHost

WARMUP_TOKENS = 4
Measured = tuple[RateResult, list[list[int]]]  # a rate and the output ids behind it
# (label of the peer, ratio target) for "ours / peer"; None: reported without a target.
TARGETS = {"hf-b1": 8.0, "hf-b8": None, "llamacpp-b1": 1.0}  # issue 19


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-requests", type=int, default=32, help="requests for our engine")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--hf-requests-b1", type=int, default=4, help="requests HF runs at batch 1")
    p.add_argument("--hf-requests-b8", type=int, default=16, help="requests HF runs at batch 8")
    p.add_argument("--llamacpp-requests", type=int, default=4, help="requests llama.cpp runs")
    p.add_argument("--skip-hf", action="store_true", help="do not run HF transformers")
    p.add_argument("--skip-llamacpp", action="store_true", help="do not run llama-cpp-python")
    p.add_argument("--threads", type=int, default=num_cores(), help="torch / llama.cpp threads")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        help="engine weight/KV dtype (default: engine's, float32 on CPU; HF stays float32)",
    )
    p.add_argument(
        "--quantization",
        choices=("int8wo", "int4wo", "w8a8_int8", "gguf"),
        help="engine quantization at load (default: none; HF stays float32)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="engine KV cache dtype (default: engine's, the weights' dtype)",
    )
    p.add_argument("--max-running-requests", type=int, help="engine setting (default: engine's)")
    p.add_argument("--chunked-prefill-size", type=int, help="engine setting (default: engine's)")
    p.add_argument(
        "--prefill-shrink-after-decodes", type=int, help="engine setting (default: engine's)"
    )
    p.add_argument(
        "--max-total-tokens", type=int, help="engine KV pool in tokens (default: fits the workload)"
    )
    p.add_argument(
        "--llamacpp-extra-bufts",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp AMX/repacked weight buffers (auto: on when a probe shows they run here)",
    )
    p.add_argument("--json-out", type=Path, help="write every number and the machine info here")
    args = p.parse_args(argv)
    for name in ("num_requests", "input_len", "output_len", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("hf_requests_b1", "hf_requests_b8", "llamacpp_requests"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
        # Peers run a prefix of our prompts, so never more of them.
        setattr(args, name, min(getattr(args, name), args.num_requests))
    return args


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    warmup_prompts: list[list[int]]
    input_len: int
    output_len: int


def make_workload(model_dir: Path, args: argparse.Namespace) -> Workload:
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    avoid = special_token_ids(model_dir)
    n, length = args.num_requests, args.input_len
    return Workload(
        prompts=random_prompts(n, length, vocab, avoid, seed=args.seed),
        # Another seed: the warm-up must leave no prefix in the radix cache for the timed run.
        warmup_prompts=random_prompts(n, min(length, 32), vocab, avoid, seed=args.seed + 1),
        input_len=length,
        output_len=args.output_len,
    )


# -- (a) radixserve ----------------------------------------------------------------------------


@dataclass
class StepRecorder:
    """A plugin on the ``step_finished`` hook: per-step timings of the timed run and a progress
    bar. First-token times assume uniform prompts prefilled one after another (the scheduler
    finishes a chunked prefill before admitting the next), no prefix-cache hits."""

    input_len: int = 0
    num_requests: int = 0
    steps: list[tuple[float, int, int, float]] = field(default_factory=list)
    bar: tqdm | None = None
    _prefilled_tokens: int = 0

    def start(self, input_len: int, num_requests: int, bar: tqdm | None) -> None:
        self.input_len, self.num_requests, self.bar = input_len, num_requests, bar
        self.steps, self._prefilled_tokens = [], 0

    @hookimpl
    def step_finished(self, stats: dict[str, Any]) -> None:
        now = time.perf_counter()
        decode, prefill = int(stats["num_decode"]), int(stats["num_prefill_tokens"])
        self.steps.append((now, decode, prefill, float(stats["step_time_s"])))
        if self.bar is not None and self.input_len:
            before = self._prefilled_tokens // self.input_len
            self._prefilled_tokens += prefill
            first_tokens = min(self._prefilled_tokens // self.input_len, self.num_requests) - before
            self.bar.update(decode + first_tokens)

    def summary(self, t0: float) -> dict[str, Any]:
        """First-token latencies (approximate) and the cost of pure decode steps."""
        first_token_s: list[float] = []
        prefilled = 0
        for now, _, prefill, _ in self.steps:
            prefilled += prefill
            done = min(prefilled // self.input_len, self.num_requests)
            first_token_s += [now - t0] * (done - len(first_token_s))
        decode_steps = [s for s in self.steps if s[2] == 0 and s[1] > 0]
        full = [s[3] for s in decode_steps if s[1] == self.num_requests]
        return {
            "steps": len(self.steps),
            "prefill_steps": sum(1 for s in self.steps if s[2] > 0),
            "decode_only_steps": len(decode_steps),
            "ttft_mean_s": statistics.fmean(first_token_s) if first_token_s else None,
            "ttft_max_s": max(first_token_s) if first_token_s else None,
            "full_batch_decode_step_ms": 1e3 * statistics.median(full) if full else None,
            "full_batch_decode_tokens_per_s": (
                self.num_requests / statistics.median(full) if full else None
            ),
        }


def start_engine(args: argparse.Namespace, recorder: StepRecorder) -> Engine:
    settings: dict[str, Any] = {
        "max_total_tokens": args.max_total_tokens
        or args.num_requests * (args.input_len + args.output_len) + 1024,
    }
    for name in (
        "dtype",
        "quantization",
        "kv_cache_dtype",
        "max_running_requests",
        "chunked_prefill_size",
        "prefill_shrink_after_decodes",
    ):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    host = PluginHost(extra_plugins=[("bench-step-recorder", recorder)])
    return Engine(model_path=None, host=host, **settings)


def _greedy(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}


def run_ours(engine: Engine, recorder: StepRecorder, work: Workload) -> Measured:
    engine.generate(input_ids=work.warmup_prompts, sampling_params=_greedy(WARMUP_TOKENS))
    engine.flush_cache()
    n = len(work.prompts)
    with tqdm(total=n * work.output_len, desc="radixserve", unit="tok") as bar:
        recorder.start(work.input_len, n, bar)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=work.prompts, sampling_params=_greedy(work.output_len))
        seconds = time.perf_counter() - t0
        bar.update(bar.total - bar.n)
    recorder.bar = None
    output_ids = [o["output_ids"] for o in outs]
    _check_lengths("radixserve", output_ids, work.output_len)
    extra = recorder.summary(t0)
    extra["e2e_latency_mean_s"] = statistics.fmean(o["meta_info"]["e2e_latency"] for o in outs)
    extra["cached_tokens"] = sum(o["meta_info"]["cached_tokens"] for o in outs)
    result = RateResult("radixserve", n, n, sum(map(len, output_ids)), seconds, extra)
    return result, output_ids


# -- (b) HF transformers -----------------------------------------------------------------------


def load_hf(model_dir: Path) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _left_pad(batch: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, batch))
    ids = [[pad_id] * (width - len(p)) + p for p in batch]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in batch]
    return torch.tensor(ids), torch.tensor(mask)


def _pad_id(model: Any) -> int:
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad)


@torch.inference_mode()
def _hf_generate(model: Any, batch: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    pad_id = _pad_id(model)
    ids, mask = _left_pad(batch, pad_id)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # EOS cannot end a sequence early
        pad_token_id=pad_id,
    )
    return out[:, ids.shape[1] :].tolist()


def run_hf(model: Any, work: Workload, num: int, batch_size: int) -> Measured:
    prompts = work.prompts[:num]
    _hf_generate(model, work.warmup_prompts[:batch_size], WARMUP_TOKENS)
    output_ids: list[list[int]] = []
    name = f"hf-b{batch_size}"
    with tqdm(total=num, desc=name, unit="req") as bar:
        t0 = time.perf_counter()
        for batch in batched(prompts, batch_size):
            output_ids += _hf_generate(model, batch, work.output_len)
            bar.update(len(batch))
        seconds = time.perf_counter() - t0
    _check_lengths(name, output_ids, work.output_len)
    return RateResult(name, num, batch_size, sum(map(len, output_ids)), seconds), output_ids


# -- (c) llama-cpp-python ----------------------------------------------------------------------


def load_llamacpp(gguf: Path, n_ctx: int, threads: int, extra_bufts: bool) -> Any:
    import llama_cpp.llama_cpp as capi
    from llama_cpp import Llama

    defaults = capi.llama_model_default_params

    def model_params() -> Any:
        params = defaults()
        params.use_extra_bufts = extra_bufts
        return params

    # Llama() exposes no use_extra_bufts argument; it reads the library's defaults.
    capi.llama_model_default_params = model_params
    try:
        return Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
    finally:
        capi.llama_model_default_params = defaults


_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, logits_all=False, verbose=False)
llm.eval(list(range(100, 132)))
llm.eval([200])
"""


def extra_bufts_usable(gguf: Path) -> bool:
    """Whether llama.cpp's extra weight buffers (AMX, repacking) run here. Some VMs advertise
    AMX in CPUID but trap its instructions (SIGILL), so try them in a child process."""
    try:
        child = subprocess.run(
            [sys.executable, "-c", _PROBE, str(gguf)], capture_output=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return False
    return child.returncode == 0


def _llamacpp_generate(llm: Any, prompt: list[int], n: int, bar: tqdm | None) -> list[int]:
    """Greedy tokens after ``prompt``; the low-level loop never stops at EOS."""
    llm.reset()  # no prefix reuse across prompts
    out: list[int] = []
    gen = llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
    try:
        for token in gen:
            out.append(int(token))
            if bar is not None:
                bar.update(1)
            if len(out) == n:
                break
    finally:
        gen.close()
    return out


def run_llamacpp(llm: Any, work: Workload, num: int) -> Measured:
    _llamacpp_generate(llm, work.warmup_prompts[0], WARMUP_TOKENS, None)
    output_ids: list[list[int]] = []
    with tqdm(total=num * work.output_len, desc="llamacpp-b1", unit="tok") as bar:
        t0 = time.perf_counter()
        for prompt in work.prompts[:num]:
            output_ids.append(_llamacpp_generate(llm, prompt, work.output_len, bar))
        seconds = time.perf_counter() - t0
    result = RateResult("llamacpp-b1", num, 1, sum(map(len, output_ids)), seconds)
    return result, output_ids


# -- report ------------------------------------------------------------------------------------


def _check_lengths(name: str, outputs: list[list[int]], expected: int) -> None:
    bad = [len(o) for o in outputs if len(o) != expected]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} outputs not {expected} tokens long: {bad[:4]}")


def agreement(ours: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How far a peer's greedy outputs match ours on the same prompts (numerics differ)."""
    prefixes = [_common_prefix(a, b) for a, b in zip(ours, other, strict=False)]
    return {
        "identical": sum(a == b for a, b in zip(ours, other, strict=False)),
        "compared": len(prefixes),
        "mean_common_prefix": statistics.fmean(prefixes) if prefixes else None,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def ratios(ours: RateResult, peers: list[RateResult]) -> dict[str, dict[str, Any]]:
    out = {}
    for peer in peers:
        ratio = ours.tokens_per_s / peer.tokens_per_s if peer.tokens_per_s else None
        target = TARGETS.get(peer.name)
        met = None if target is None or ratio is None else ratio >= target
        out[peer.name] = {"ratio": ratio, "target": target, "met": met}
    return out


HEADERS = (
    "system",
    "requests",
    "batch",
    "out tokens",
    "seconds",
    "tok/s",
    "ours / this",
    "target",
    "same output",
)


def _row(r: RateResult, rel: dict[str, Any] | None) -> list[Any]:
    ratio = f"{rel['ratio']:.2f}x" if rel and rel["ratio"] is not None else None
    target = None
    if rel and rel["target"] is not None:
        target = f">= {rel['target']:g}x" + ("" if rel["met"] else " MISSED")
    match = r.extra.get("agreement")
    same = f"{match['identical']}/{match['compared']}" if match else None
    return [r.name, r.requests, r.batch_size, r.output_tokens, r.seconds, r.tokens_per_s,
            ratio, target, same]  # fmt: skip


def report(ours: RateResult, peers: list[RateResult], rel: dict[str, dict[str, Any]]) -> str:
    rows = [_row(r, rel.get(r.name)) for r in [ours, *peers]]
    lines = [format_table(HEADERS, rows)]
    s = ours.extra
    if s.get("ttft_mean_s") is not None:
        lines.append(
            f"radixserve: first token mean {s['ttft_mean_s']:.2f}s, max {s['ttft_max_s']:.2f}s "
            f"(approx., from step timings); {s['steps']} steps, {s['prefill_steps']} with prefill"
        )
    if s.get("full_batch_decode_step_ms") is not None:
        lines.append(
            f"radixserve: decode step at batch {ours.batch_size}: "
            f"{s['full_batch_decode_step_ms']:.1f} ms median "
            f"({s['full_batch_decode_tokens_per_s']:.1f} tok/s without prefill)"
        )
    return "\n".join(lines)


def hf_phase(args: argparse.Namespace, model_dir: Path, work: Workload) -> list[Measured]:
    model = load_hf(model_dir)
    runs = [run_hf(model, work, num, bs) for num, bs in
            ((args.hf_requests_b1, 1), (args.hf_requests_b8, 8)) if num]  # fmt: skip
    del model
    gc.collect()
    return runs


def llamacpp_phase(args: argparse.Namespace, work: Workload) -> Measured:
    n_ctx = max(512, args.input_len + args.output_len + 8)
    gguf = default_gguf_path()
    mode = args.llamacpp_extra_bufts
    extra_bufts = extra_bufts_usable(gguf) if mode == "auto" else mode == "on"
    if not extra_bufts:
        print("llama.cpp: extra weight buffers (AMX/repack) off", file=sys.stderr)
    llm = load_llamacpp(gguf, n_ctx, args.threads, extra_bufts)
    result, outputs = run_llamacpp(llm, work, args.llamacpp_requests)
    result.extra.update(n_ctx=n_ctx, extra_bufts=extra_bufts)
    return result, outputs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info()  # before the run: its load average says how quiet the host was
    recorder = StepRecorder()
    engine = start_engine(args, recorder)
    model_dir = engine.model_dir
    work = make_workload(model_dir, args)
    print(
        f"workload: {args.num_requests} requests x {args.input_len} prompt tokens -> "
        f"{args.output_len} output tokens; threads={args.threads}; model={model_dir}",
        file=sys.stderr,
    )
    try:
        ours, our_outputs = run_ours(engine, recorder, work)
    finally:
        engine.shutdown()
    del engine
    gc.collect()

    runs: list[Measured] = []
    if not args.skip_hf and (args.hf_requests_b1 or args.hf_requests_b8):
        runs += hf_phase(args, model_dir, work)
    if not args.skip_llamacpp and args.llamacpp_requests:
        runs.append(llamacpp_phase(args, work))
    for result, outputs in runs:
        result.extra["agreement"] = agreement(our_outputs, outputs)
    peers = [result for result, _ in runs]

    rel = ratios(ours, peers)
    print(report(ours, peers, rel))
    if args.json_out:
        payload = {
            "benchmark": "offline",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": {**machine, "load_avg_1m_end": os.getloadavg()[0]},
            "results": [r.to_json() for r in [ours, *peers]],
            "ratios": rel,
        }
        write_json(args.json_out, payload)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
