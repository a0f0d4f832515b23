"""Online serving benchmark: TTFT, ITL, TPOT, end-to-end latency and throughput of a running
server, through its streaming OpenAI ``/v1/completions`` or native ``/generate`` endpoint.

    python bench/serving.py --base-url http://127.0.0.1:30000 --backend openai \
        --num-prompts 64 --input-len 256 --output-len 128 --max-concurrency 8

Prompts are random token ids (``random``) or groups sharing a long prefix (``shared-prefix``);
outputs ignore EOS so every request produces exactly its output length. Requests arrive as a
Poisson process (``--request-rate``) or all at once, capped by ``--max-concurrency``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from common import machine_info, random_prompts, write_json
from tqdm.asyncio import tqdm


@dataclass
class Request:
    input_ids: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    rng = random.Random(args.seed)
    avoid = set(range(min(100, vocab_size // 2)))  # the low ids, where special tokens live

    def length(n: int) -> int:
        return rng.randint(max(int(n * args.random_range_ratio), 1), n)

    bodies = random_prompts(args.num_prompts, args.input_len, vocab_size, avoid, args.seed)
    reqs = [Request(ids[: length(args.input_len)], length(args.output_len)) for ids in bodies]
    if args.dataset == "shared-prefix":
        prefixes = random_prompts(args.num_groups, args.prefix_len, vocab_size, avoid, ~args.seed)
        for i, req in enumerate(reqs):
            req.input_ids = prefixes[i % args.num_groups] + req.input_ids
        rng.shuffle(reqs)
    return reqs


def payload(backend: str, model: str, req: Request) -> tuple[str, dict[str, Any]]:
    if backend == "openai":
        return "/v1/completions", {
            "model": model,
            "prompt": req.input_ids,
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    return "/generate", {
        "input_ids": req.input_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": True},
    }


def tokens_in(backend: str, event: dict[str, Any]) -> int | None:
    """Output tokens so far as the event reports them (None when it does not say)."""
    if backend == "openai":
        usage = event.get("usage")
        return usage["completion_tokens"] if usage else None
    return event["meta_info"]["completion_tokens"]


async def send(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str, req: Request
) -> Result:
    path, body = payload(args.backend, model, req)
    result = Result(prompt_len=len(req.input_ids))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                now = time.perf_counter()
                before = result.output_tokens
                count = tokens_in(args.backend, event)
                if count is not None:
                    result.output_tokens = count
                if event.get("choices") == []:  # the usage-only chunk carries no token
                    continue
                if result.ttft == 0.0:
                    result.ttft = now - start
                elif count is None:  # OpenAI chunks: one gap per chunk, as SGLang's client
                    result.itl.append(now - last)
                elif count > before:  # native: the gap spread over the chunk's tokens, as SGLang
                    result.itl.extend([(now - last) / (count - before)] * (count - before))
                else:
                    continue  # no new token: the gap goes on
                last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens == req.output_len
        if not result.ok:
            result.error = f"expected {req.output_len} tokens, got {result.output_tokens}"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


# Streams per HTTP client: httpx's pool scans all its connections for every request event,
# so one client holding 256 streams spent most of the benchmark's CPU in that scan (profiled
# on the H200 run: the client, not the server, capped throughput). Small pools keep it flat.
STREAMS_PER_CLIENT = 16
# Streams one client process follows: past this a single Python process parsing every SSE
# event is slower than the server it measures (H200, 256 streams: TPOT set by the client).
STREAMS_PER_PROCESS = 64


async def _send_all(
    args: argparse.Namespace,
    model: str,
    reqs: list[Request],
    concurrency: int,
    start_at: float | None = None,
) -> tuple[list[Result], float, float]:
    """Send ``reqs`` (at most ``concurrency`` at once), arrivals as ``--request-rate`` says;
    returns the results in order and the perf_counter times of the first send and last end.
    ``start_at``: a time.time() to wait for, so that client processes start together."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    num_clients = max(1, -(-concurrency // STREAMS_PER_CLIENT))
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=args.base_url,
                    headers=headers,
                    timeout=httpx.Timeout(None),
                    limits=limits,
                )
            )
            for _ in range(num_clients)
        ]
        sem = asyncio.Semaphore(concurrency)
        rng = random.Random(args.seed + 1)
        bar = tqdm(total=len(reqs), disable=args.disable_tqdm or start_at is not None)

        async def limited(req: Request, client: httpx.AsyncClient) -> Result:
            async with sem:
                out = await send(client, args, model, req)
            bar.update(1)
            return out

        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        tasks = []
        start = time.perf_counter()
        for i, req in enumerate(reqs):
            tasks.append(asyncio.create_task(limited(req, clients[i % num_clients])))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        end = time.perf_counter()
        bar.close()
    return list(results), start, end


def _send_share(
    args: argparse.Namespace, model: str, reqs: list[Request], concurrency: int, start_at: float
) -> tuple[list[Result], float, float, float]:
    """One client process's share (run in a spawned process); with the CPU seconds it spent
    from its first send to its last end (near the wall time: the client is what waits)."""
    cpu = 0.0

    async def timed() -> tuple[list[Result], float, float]:
        nonlocal cpu
        begin = time.process_time()  # (waiting for start_at costs no CPU)
        out = await _send_all(args, model, reqs, concurrency, start_at)
        cpu = time.process_time() - begin
        return out

    results, start, end = asyncio.run(timed())
    return results, start, end, cpu


def client_processes(args: argparse.Namespace, num_reqs: int) -> int:
    """How many client processes: ``--client-processes``, else one per STREAMS_PER_PROCESS
    concurrent streams; always one with a Poisson arrival rate (one process draws arrivals)."""
    if args.request_rate != float("inf"):
        return 1
    wanted = getattr(args, "client_processes", None)
    if wanted is None:
        wanted = -(-(args.max_concurrency or num_reqs) // STREAMS_PER_PROCESS)
    return max(1, min(wanted, num_reqs))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=httpx.Timeout(None)
    ) as client:
        info = (await client.get("/get_model_info")).json()
        model = args.model or info.get("model_path", "default")
        vocab = args.vocab_size or info.get("vocab_size") or 32000
        reqs = make_requests(args, vocab)
        for warm in reqs[: args.warmup]:
            await send(client, args, model, Request(warm.input_ids, 4))
    concurrency = args.max_concurrency or len(reqs)
    procs = client_processes(args, len(reqs))
    if procs == 1:
        results, start, end = await _send_all(args, model, reqs, concurrency)
        return summarize(args, results, end - start, model)
    # Round-robin shares, each process with its part of the concurrency; all start at once.
    shares = [reqs[i::procs] for i in range(procs)]
    limits = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    start_at = time.time() + 3.0  # time to spawn and import
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        futures = [
            asyncio.wrap_future(pool.submit(_send_share, args, model, share, max(1, lim), start_at))
            for share, lim in zip(shares, limits, strict=True)
        ]
        parts = await asyncio.gather(*futures)
    results = [Result()] * len(reqs)
    for i, (part, _, _, _) in enumerate(parts):
        results[i::procs] = part
    duration = max(e for _, _, e, _ in parts) - min(s for _, s, _, _ in parts)
    summary = summarize(args, results, duration, model)
    summary["client_processes_busy"] = [round(cpu / (e - s), 3) for _, s, e, cpu in parts]
    return summary


STAT_KEYS = ("mean", "median", "std", "p90", "p95", "p99")


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """Mean, median, std and percentiles as SGLang's and vLLM's benchmark clients compute them
    (numpy: linear interpolation between ranks, population std), in ms."""
    if not values:
        return dict.fromkeys(STAT_KEYS, 0.0)
    a = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(np.mean(a)),
        "median": float(np.median(a)),
        "std": float(np.std(a)),
        "p90": float(np.percentile(a, 90)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(
    args: argparse.Namespace, results: list[Result], duration: float, model: str
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "backend": args.backend,
        "dataset": args.dataset,
        "model": model,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "concurrency": sum(r.latency for r in ok) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "itl_ms": _stats([gap for r in ok for gap in r.itl]),
        "tpot_ms": _stats(tpot),
        "e2e_latency_ms": _stats([r.latency for r in ok]),
    }
    wave = args.max_concurrency or len(results)
    if len(results) > wave:  # the first wave is sent at once, the rest as earlier ones finish
        for key, part in (("first_wave", results[:wave]), ("later", results[wave:])):
            summary[f"ttft_median_ms_{key}"] = _stats([r.ttft for r in part if r.ok])["median"]
    if args.baseline_output_throughput:
        summary["ratio_to_baseline"] = (
            summary["output_throughput"] / args.baseline_output_throughput
        )
    return summary


def print_summary(s: dict[str, Any]) -> None:
    print(f"\n{'=' * 20} serving benchmark ({s['backend']}, {s['dataset']}) {'=' * 20}")
    for key in (
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "total_token_throughput",
        "concurrency",
    ):
        value = s[key]
        print(f"{key:<28}{value:>14.2f}" if isinstance(value, float) else f"{key:<28}{value:>14}")
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        st = s[key]
        print(f"{key:<28}" + "  ".join(f"{k} {st[k]:>8.2f}" for k in STAT_KEYS))
    if "ratio_to_baseline" in s:
        print(f"{'output tok/s vs baseline':<28}{s['ratio_to_baseline']:>14.3f}")
    for err in s["errors"]:
        print(f"error: {err}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", choices=("openai", "native"), default="openai")
    p.add_argument("--model", default=None, help="Model name sent to OpenAI routes")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="Prompt (suffix) tokens")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="Lengths are drawn from [len * ratio, len]",
    )
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: prefix tokens")
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: distinct prefixes")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate, req/s")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="Default: from /get_model_info")
    p.add_argument("--warmup", type=int, default=1, help="Short requests sent before timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline-output-throughput",
        type=float,
        default=None,
        help="Engine-only output tok/s (e.g. from bench/offline.py) to compare to",
    )
    p.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help=f"Client processes (default: one per {STREAMS_PER_PROCESS} concurrent streams)",
    )
    p.add_argument("--json-out", default=None, help="Write the summary here as JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    print_summary(summary)
    if args.json_out:
        settings = {**vars(args), "api_key": "***" if args.api_key else None}
        write_json(args.json_out, {"args": settings, "machine": machine_info(), **summary})
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
