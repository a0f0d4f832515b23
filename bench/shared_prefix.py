#!/usr/bin/env python
"""Shared-prefix benchmark: the radix cache on against off, in one run, on the same engine
settings and the same prompts.

Traffic: G groups of R requests; each group shares one P-token prefix (a long system prompt or
document), each request adds its own Q-token question and generates O tokens (greedy, EOS
ignored). All requests are submitted at once. Reported: output tok/s with the cache on and off,
their ratio, the prompt tokens served from the cache, and the share of requests whose greedy
outputs are identical between the two runs (bf16 kernels over different chunkings may flip a
near-tie, so this is a share, not an assertion).

    python bench/shared_prefix.py --json-out $OUT/shared-prefix.json          # 8B shape, H200
    python bench/shared_prefix.py --shape tiny --hardware cpu --attention torch_native --small
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import machine_info, write_json  # noqa: E402
from gpu import StepStats, bench_host, timed  # noqa: E402
from gpu_model import SHAPES, write_random_llama  # noqa: E402

from radixserve import Engine  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--hardware", default="cuda")
    p.add_argument("--attention", default="triton")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--question", type=int, default=128)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=400_000,
                   help="KV pool of both runs (the same for on and off)")  # fmt: skip
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU) or float32")
    p.add_argument("--small", action="store_true", help="a smoke-test size")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.small:
        args.groups, args.per_group, args.prefix, args.question, args.output = 4, 4, 64, 8, 8
        args.max_total_tokens, args.max_running = 4096, 16
    return args


def traffic(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    """Requests interleaved across groups (arrival order does not favour the cache)."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    prefixes = [draw(args.prefix) for _ in range(args.groups)]
    return [prefixes[g] + draw(args.question) for _ in range(args.per_group)
            for g in range(args.groups)]  # fmt: skip


def run(model_dir: Path, args: argparse.Namespace, vocab: int, cache: bool) -> dict[str, Any]:
    context = args.prefix + args.question + args.output + 8
    engine = Engine(
        str(model_dir), host=bench_host(StepStats()),
        plugins=[f"hardware={args.hardware}", f"attention={args.attention}", "grammar=none"],
        max_running_requests=args.max_running, max_total_tokens=args.max_total_tokens,
        context_length=context, chunked_prefill_size=args.chunked_prefill_size,
        cuda_graph_max_bs=args.max_running, disable_radix_cache=not cache, dtype=args.dtype,
    )  # fmt: skip
    params = {"temperature": 0.0, "max_new_tokens": args.output, "ignore_eos": True}
    try:
        # Warm-up on other prompts (kernels, graphs, allocator), then an empty cache.
        warm = traffic(argparse.Namespace(**{**vars(args), "groups": 2, "per_group": 2}), vocab, 1)
        engine.generate(input_ids=warm, sampling_params={**params, "max_new_tokens": 4})
        engine.flush_cache()
        stats = engine.core.scheduler.stats
        cached_before, prompt_before = stats.cached_tokens, stats.prompt_tokens
        outputs: list[list[int]] = []
        batch = traffic(args, vocab, 2)

        def go() -> None:
            results = engine.generate(input_ids=batch, sampling_params=params)
            outputs.extend(r["output_ids"] for r in results)

        seconds = timed(go)
        return {
            "seconds": seconds,
            "output_tok_s": len(batch) * args.output / seconds,
            "cached_prompt_share": (stats.cached_tokens - cached_before)
            / max(stats.prompt_tokens - prompt_before, 1),
            "retractions": stats.retractions,
            "outputs": outputs,
        }
    finally:
        engine.shutdown()


def main() -> None:
    args = parse_args()
    import torch

    res: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    if torch.cuda.is_available():
        res["gpu"] = torch.cuda.get_device_name()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-shared-prefix-"))
    model_dir = workdir / args.shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    if not (model_dir / "config.json").exists():
        write_random_llama(model_dir, args.shape, device)
    print(f"model ready in {time.perf_counter() - start:.0f}s", flush=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    on = run(model_dir, args, vocab, cache=True)
    off = run(model_dir, args, vocab, cache=False)
    pairs = list(zip(on.pop("outputs"), off.pop("outputs"), strict=True))
    same = sum(a == b for a, b in pairs)
    n = args.groups * args.per_group
    # Random weights give near-uniform logits, so in bf16 a different chunking of the same
    # prompt flips near-ties; how far outputs agree says more than whether they agree to the end.
    common = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in pairs
    ]
    res["first_token_identical"] = sum(c > 0 for c in common) / n
    res["mean_common_prefix_tokens"] = sum(common) / n
    res.update(
        cache_on=on,
        cache_off=off,
        on_over_off=on["output_tok_s"] / off["output_tok_s"],
        identical_outputs=same / n,
    )
    print(
        f"{args.groups} groups x {args.per_group} requests, {args.prefix}-token shared prefix + "
        f"{args.question}-token question, {args.output} out ({args.shape}, {args.dtype}, "
        f"{res.get('gpu', 'cpu')})"
    )
    print(f"  cache on : {on['output_tok_s']:10.1f} output tok/s  "
          f"({on['cached_prompt_share']:.1%} of prompt tokens from the cache)")  # fmt: skip
    print(f"  cache off: {off['output_tok_s']:10.1f} output tok/s")
    print(f"  on / off : {res['on_over_off']:.2f}x")
    print(f"  identical greedy outputs: {same}/{n} ({same / n:.1%}); first token identical: "
          f"{res['first_token_identical']:.1%}; mean common prefix: "
          f"{res['mean_common_prefix_tokens']:.1f} of {args.output} tokens")  # fmt: skip
    if args.json_out:
        write_json(args.json_out, res)


if __name__ == "__main__":
    main()
