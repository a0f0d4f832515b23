#!/usr/bin/env python
"""Data parallelism behind sglang-router: cache-aware routing against round-robin, in one run.

N radixserve servers (same model, same settings) stand behind ``sglang_router.launch_router
--worker-urls ...``; the same generated-shared-prefix traffic (SGLang bench_serving's shape: G
groups of R requests, each group sharing one P-token system prompt, each request adding its own
Q-token question and generating O tokens, greedy, EOS ignored; shuffled, C in flight) goes
through the router once with ``--policy round_robin`` and once with ``--policy cache_aware``,
every server's cache flushed before each. Reported per policy: the prefix-cache hit rate
(cached prompt tokens / prompt tokens, summed from the responses' meta_info), output tokens/s
and requests/s; and cache-aware's hit rate over round-robin's.

Each server's KV pool is sized to hold about G/N + 1 group prompts: cache-aware routing keeps
each group on one server, where its prompt stays cached; round-robin spreads every group over
all servers, each of which would have to hold all G prompts.

    python bench/dp_router.py                       # tiny random Llama on CPU, 4 servers
    python bench/dp_router.py --json-out $OUT/dp-router.json
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

from common import format_table, machine_info, write_json  # noqa: E402
from gpu_model import write_random_llama  # noqa: E402

READY = "radixserve ready at "


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--question", type=int, default=16)
    p.add_argument("--output", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=0,
                   help="KV pool per server (default: about groups/servers + 1 prompts, plus "
                        "room for the requests in flight)")  # fmt: skip
    p.add_argument("--model", default=None, help="a model directory (default: tiny random Llama)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, kv_tokens: int, log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1",
           "--port", str(port), "--model-path", str(model),
           "--max-total-tokens", str(kv_tokens)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return f"http://127.0.0.1:{port}", proc


def wait_ready(logs: list[Path], procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if all(READY in log.read_text(errors="replace") for log in logs):
            return
        for log, proc in zip(logs, procs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        time.sleep(0.25)
    raise RuntimeError("servers not ready in 300 s")


def start_router(urls: list[str], policy: str, log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--worker-urls", *urls,
           "--policy", policy, "--log-level", "warn"]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            workers = requests.get(url + "/workers", timeout=5).json()["workers"]
            if len(workers) == len(urls) and all(w["is_healthy"] for w in workers):
                return url, proc
        except requests.RequestException:
            pass
        time.sleep(0.25)
    proc.terminate()
    raise RuntimeError(f"router not ready: {log.read_text()[-2000:]}")


def traffic(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefixes = [ids(args.prefix) for _ in range(args.groups)]
    prompts = [p + ids(args.question) for p in prefixes for _ in range(args.per_group)]
    rng.shuffle(prompts)
    return prompts


def run_policy(url: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    params = {"max_new_tokens": args.output, "temperature": 0, "ignore_eos": True}

    def one(ids: list[int]) -> dict[str, Any]:
        r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": params},
                          timeout=600)  # fmt: skip
        r.raise_for_status()
        return r.json()["meta_info"]

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        metas = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    output = sum(m["completion_tokens"] for m in metas)
    return {
        "hit_rate": cached / prompt,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "output_tok_s": output / wall,
        "req_s": len(metas) / wall,
        "wall_s": wall,
    }


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="dp-router-"))
    model = Path(args.model) if args.model else work / "model"
    if args.model is None:
        write_random_llama(model, "tiny", "cpu")
    vocab = int(__import__("json").loads((model / "config.json").read_text())["vocab_size"])
    per_request = args.prefix + args.question + args.output
    in_flight = -(-args.concurrency // args.servers) + 1
    kv = args.kv_tokens or (args.groups // args.servers + 1) * args.prefix + in_flight * per_request
    logs = [work / f"server{i}.log" for i in range(args.servers)]
    started = [start_server(model, kv, log) for log in logs]
    urls, procs = [u for u, _ in started], [p for _, p in started]
    results: dict[str, Any] = {}
    try:
        wait_ready(logs, procs)
        prompts = traffic(args, vocab)
        for policy in ("round_robin", "cache_aware"):
            for u in urls:
                requests.post(u + "/flush_cache", timeout=60).raise_for_status()
            url, router = start_router(urls, policy, work / f"router-{policy}.log")
            try:
                results[policy] = run_policy(url, prompts, args)
            finally:
                router.send_signal(signal.SIGTERM)
                router.wait(30)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(60)
    rr, ca = results["round_robin"], results["cache_aware"]
    ratio = ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    rows = [
        [policy, f"{r['hit_rate']:.3f}", r["cached_tokens"], r["prompt_tokens"],
         f"{r['output_tok_s']:.1f}", f"{r['req_s']:.2f}"]
        for policy, r in results.items()
    ]  # fmt: skip
    print(format_table(["policy", "hit rate", "cached", "prompt", "out tok/s", "req/s"], rows))
    print(f"cache-aware hit rate / round-robin: {ratio:.2f}x; "
          f"throughput ratio {ca['output_tok_s'] / rr['output_tok_s']:.2f}x")  # fmt: skip
    print(f"{args.servers} servers, {args.groups} groups x {args.per_group} requests, prefix "
          f"{args.prefix}, question {args.question}, output {args.output}, concurrency "
          f"{args.concurrency}, KV {kv} tokens per server")  # fmt: skip
    if args.json_out:
        write_json(args.json_out, {"args": vars(args), "kv_tokens": kv, "results": results,
                                   "hit_rate_ratio": ratio, "machine": machine_info()})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
