#!/usr/bin/env python
"""Structured outputs on CPU: constrained against unconstrained decoding, per grammar backend.

For each backend in ``--backends`` one ``Engine(plugins=["grammar=NAME"])`` (the default model,
SmolLM2-135M-Instruct) runs, on the same ``--batch-size`` chat prompts submitted at once:

  (a) unconstrained: ``max_new_tokens`` tokens, EOS ignored (every row emits exactly that many);
  (b) constrained: the same prompts and ``max_new_tokens``, with a ``--kind`` constraint
      (``json_schema`` by default). Rows end when the grammar terminates, possibly before
      ``max_new_tokens``, so (a) and (b) compare *rates*: output tokens / wall time.

Both sample at temperature 0.7 with one seed per prompt (prompt i: seed ``--seed + i``). Each
timed run follows a warm-up batch (which also compiles the grammar, so the timed constrained run
hits the engine's grammar cache) and a cache flush (no prefix hits from the warm-up).
Jump-forward is off unless ``--jump-forward``: forced tokens are appended without a model step
and would inflate the constrained rate; the ratio then measures the cost of masking alone.

Reported per backend: both rates and their ratio (target >= 0.85 with xgrammar); the per-token
mask time (``GrammarMasker.apply`` per step, bitmask fill + copy + logits masking, divided by the
step's constrained rows; wrapped in this script only) at p50 / p99; and the compile time of the
spec called on the backend directly: cold (first compile on a freshly built backend) and warm
(the same spec compiled again on that backend; the engine's LRU cache of compiled grammars
skips compile altogether on a repeat, see core/grammar_queue.py), plus the backend build time.

    .venv/bin/python bench/structured.py --json-out bench/results/structured-cpu.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import RateResult, format_table, machine_info, num_cores, write_json
from tqdm import tqdm

from radixserve import Engine
from radixserve.core.grammar import GrammarMasker

BACKENDS = ("xgrammar", "outlines", "llguidance")
TARGET_RATIO = {"xgrammar": 0.85}
TEMPERATURE = 0.7
WARMUP_TOKENS = 8
COMPILE_REPEATS = 5

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"},
        "city": {"type": "string", "maxLength": 32},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}},
        "bio": {"type": "string", "maxLength": 80},
    },
    "required": ["name", "age", "email", "city", "hobbies", "bio"],
}
SPECS: dict[str, str] = {
    "json_schema": json.dumps(SCHEMA),
    "regex": r"([A-Z][a-z]{2,10} ){3,40}[A-Z][a-z]{2,10}\.",
    "ebnf": 'root ::= item ("," " " item)*\nitem ::= [a-z]+ " " [0-9]+',
}
TASK = {
    "json_schema": "Describe person number {i} (name, age, email, city, hobbies, bio) as JSON.",
    "regex": "Write a sentence of capitalised words about city number {i}.",
    "ebnf": "List items with counts for shop number {i}, like 'apples 3, pears 5'.",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help=f"comma-separated grammar backends, of: {', '.join(BACKENDS)}",
    )
    p.add_argument("--batch-size", type=int, default=16, help="prompts submitted at once")
    p.add_argument("--max-new-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--kind", choices=tuple(SPECS), default="json_schema", help="constraint kind")
    p.add_argument("--jump-forward", action="store_true", help="keep the engine's jump-forward")
    p.add_argument("--threads", type=int, default=num_cores(), help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt 0 (prompt i: seed + i)")
    p.add_argument("--json-out", type=Path, help="write every number and the machine info here")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown or not args.backends:
        p.error(f"--backends: unknown {unknown}; choose from {', '.join(BACKENDS)}")
    for name in ("batch_size", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# -- mask timing -------------------------------------------------------------------------------


@dataclass
class MaskTimer:
    """Wraps ``GrammarMasker.apply`` (class-wide, this process only): per-step seconds and the
    step's constrained rows, while ``active``."""

    active: bool = False
    steps: list[tuple[float, int]] = field(default_factory=list)

    def install(self) -> None:
        original = GrammarMasker.apply
        timer = self

        def timed_apply(masker: GrammarMasker, logits: torch.Tensor, reqs: Sequence[Any]) -> bool:
            if not timer.active:
                return original(masker, logits, reqs)
            t0 = time.perf_counter()
            masked = original(masker, logits, reqs)
            seconds = time.perf_counter() - t0
            if masked:
                timer.steps.append((seconds, sum(r.grammar is not None for r in reqs)))
            return masked

        GrammarMasker.apply = timed_apply  # type: ignore[method-assign]

    def start(self) -> None:
        self.steps, self.active = [], True

    def stop(self) -> dict[str, Any]:
        self.active = False
        per_token = sorted(s / rows for s, rows in self.steps if rows)
        per_step = sorted(s for s, _ in self.steps)
        return {
            "mask_steps": len(self.steps),
            "mask_rows_mean": (statistics.fmean(r for _, r in self.steps) if self.steps else None),
            "mask_step_p50_ms": _pct_ms(per_step, 50),
            "mask_step_p99_ms": _pct_ms(per_step, 99),
            "mask_per_token_p50_us": _pct_us(per_token, 50),
            "mask_per_token_p99_us": _pct_us(per_token, 99),
            "mask_total_s": sum(per_step),
        }


def _pct(sorted_values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * pct // 100))
    return sorted_values[min(int(rank), len(sorted_values)) - 1]


def _pct_ms(values: list[float], pct: float) -> float | None:
    v = _pct(values, pct)
    return None if v is None else 1e3 * v


def _pct_us(values: list[float], pct: float) -> float | None:
    v = _pct(values, pct)
    return None if v is None else 1e6 * v


# -- compile timing ----------------------------------------------------------------------------


def time_compile(engine: Engine, backend: str, kind: str, spec: str) -> dict[str, Any]:
    """Build a fresh backend the way the engine does, then compile ``spec`` on it directly."""
    core = engine.core
    factory = engine.host.registries["grammar"].get(backend).factory
    vocab = core.runner.model_config.vocab_size
    t0 = time.perf_counter()
    instance = factory(core.tokenizer, vocab, list(core.eos_token_ids))
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    instance.compile(kind, spec)
    cold_s = time.perf_counter() - t0
    warm = []
    for _ in range(COMPILE_REPEATS):
        t0 = time.perf_counter()
        instance.compile(kind, spec)
        warm.append(time.perf_counter() - t0)
    return {
        "backend_build_ms": 1e3 * build_s,
        "compile_cold_ms": 1e3 * cold_s,
        "compile_warm_ms": 1e3 * statistics.median(warm),
    }


# -- runs --------------------------------------------------------------------------------------


def make_prompts(engine: Engine, kind: str, n: int, offset: int = 0) -> list[list[int]]:
    msgs = [[{"role": "user", "content": TASK[kind].format(i=offset + i)}] for i in range(n)]
    return [engine.tokenizer.encode_chat(m) for m in msgs]


def params(args: argparse.Namespace, seed: int, max_new: int, constrained: bool) -> dict:
    p: dict[str, Any] = {"max_new_tokens": max_new, "temperature": TEMPERATURE, "seed": seed}
    if constrained:
        p[args.kind] = SPECS[args.kind]
    else:
        p["ignore_eos"] = True
    return p


def run_batch(
    engine: Engine, prompts: list[list[int]], args: argparse.Namespace, max_new: int, cons: bool
) -> list[dict[str, Any]]:
    """Every prompt submitted at once, prompt i with its own seed (one generate call each)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(
                engine.generate,
                input_ids=ids,
                sampling_params=params(args, args.seed + i, max_new, cons),
            )
            for i, ids in enumerate(prompts)
        ]
        return [f.result(timeout=3600) for f in futures]


def measure(
    engine: Engine,
    name: str,
    prompts: list[list[int]],
    warmup: list[list[int]],
    args: argparse.Namespace,
    constrained: bool,
    timer: MaskTimer,
    bar: tqdm,
) -> RateResult:
    run_batch(engine, warmup, args, WARMUP_TOKENS, constrained)
    engine.flush_cache()
    timer.start()
    t0 = time.perf_counter()
    outs = run_batch(engine, prompts, args, args.max_new_tokens, constrained)
    seconds = time.perf_counter() - t0
    mask = timer.stop()
    bar.update(1)
    counts = [len(o["output_ids"]) for o in outs]
    reasons: dict[str, int] = {}
    for o in outs:
        reason = o["meta_info"]["finish_reason"]
        key = reason["type"] if isinstance(reason, dict) else str(reason)
        reasons[key] = reasons.get(key, 0) + 1
    extra: dict[str, Any] = {
        "constrained": constrained,
        "output_tokens_mean": statistics.fmean(counts),
        "output_tokens_min": min(counts),
        "finish_reasons": reasons,
    }
    if constrained:
        extra.update(mask)
        extra["valid_outputs"] = sum(_valid(args.kind, o["text"]) for o in outs)
    return RateResult(name, len(prompts), len(prompts), sum(counts), seconds, extra)


def _valid(kind: str, text: str) -> bool:
    """JSON outputs parse and validate against the schema (``jsonschema``, when installed; a row
    cut at max_new_tokens does not); other kinds are not checked."""
    if kind != "json_schema":
        return True
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True
    return jsonschema.Draft202012Validator(SCHEMA).is_valid(value)


def run_backend(
    backend: str, args: argparse.Namespace, timer: MaskTimer, bar: tqdm
) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "max_total_tokens": 2 * args.batch_size * (256 + args.max_new_tokens) + 1024,
        "max_running_requests": max(args.batch_size, 1),
        "disable_jump_forward": not args.jump_forward,
    }
    with Engine(model_path=None, plugins=[f"grammar={backend}"], **settings) as engine:
        compile_times = time_compile(engine, backend, args.kind, SPECS[args.kind])
        bar.update(1)
        prompts = make_prompts(engine, args.kind, args.batch_size)
        # Other prompt texts: the warm-up leaves no useful prefix behind (the cache is flushed
        # too), and compiles the spec into the engine's grammar cache.
        warmup = make_prompts(engine, args.kind, args.batch_size, offset=10_000)
        free = measure(engine, f"{backend}/free", prompts, warmup, args, False, timer, bar)
        cons = measure(engine, f"{backend}/{args.kind}", prompts, warmup, args, True, timer, bar)
        jump = engine.core.grammar_stepper.jump_forward_tokens
    ratio = cons.tokens_per_s / free.tokens_per_s if free.tokens_per_s else None
    target = TARGET_RATIO.get(backend)
    return {
        "backend": backend,
        "unconstrained": free.to_json(),
        "constrained": cons.to_json(),
        "ratio": ratio,
        "target_ratio": target,
        "meets_target": None if target is None or ratio is None else ratio >= target,
        "jump_forward_tokens": jump,
        **compile_times,
    }


def report(results: list[dict[str, Any]]) -> str:
    headers = [
        "backend",
        "free tok/s",
        "constr tok/s",
        "ratio",
        "target",
        "constr tok/req",
        "valid",
        "mask/tok p50 us",
        "mask/tok p99 us",
        "compile cold ms",
        "compile warm ms",
        "build ms",
    ]
    rows = []
    for r in results:
        c = r["constrained"]
        rows.append(
            [
                r["backend"],
                r["unconstrained"]["tokens_per_s"],
                c["tokens_per_s"],
                r["ratio"],
                "-" if r["target_ratio"] is None else f">= {r['target_ratio']}",
                c["extra"]["output_tokens_mean"],
                f"{c['extra']['valid_outputs']}/{c['requests']}",
                c["extra"]["mask_per_token_p50_us"],
                c["extra"]["mask_per_token_p99_us"],
                r["compile_cold_ms"],
                r["compile_warm_ms"],
                r["backend_build_ms"],
            ]
        )
    return format_table(headers, rows)


def grammar_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for dist in ("xgrammar", "outlines-core", "outlines", "llguidance"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info()  # before the run: its load average says how quiet the host was
    timer = MaskTimer()
    timer.install()
    print(
        f"workload: {args.batch_size} chat prompts x {args.max_new_tokens} new tokens, "
        f"kind={args.kind}, temperature={TEMPERATURE}, jump_forward={args.jump_forward}, "
        f"threads={args.threads}, backends={','.join(args.backends)}",
        file=sys.stderr,
    )
    results = []
    # Per backend: compile timing, unconstrained run, constrained run.
    with tqdm(total=3 * len(args.backends), desc="structured", unit="phase") as bar:
        for backend in args.backends:
            bar.set_postfix_str(backend)
            results.append(run_backend(backend, args, timer, bar))
    print(report(results))
    if args.json_out:
        payload = {
            "benchmark": "structured",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "spec": SPECS[args.kind],
            "machine": {**machine, "load_avg_1m_end": os.getloadavg()[0]},
            "grammar_libraries": grammar_versions(),
            "results": results,
        }
        write_json(args.json_out, payload)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
