#!/usr/bin/env python
"""Agent sessions: time to first token per turn of agent-like conversations, with sessions
(/open_session, ``session_params``: the context stays pinned in the KV cache between turns)
against without (the client sends the whole context every turn; other traffic may evict it),
both phases in one run against one server.

Workload (the issue's shape, the defaults): S sessions of T turns; each turn appends a tool
output of K tokens and a user message of U tokens and generates O tokens (greedy, EOS ignored);
meanwhile C other clients send unrelated prompts (P tokens, O2 out) back to back until every
session is done. Reported per turn index: TTFT p50 and p99 across sessions, and the mean cached
tokens, for sessions off and on; and the p50/p99 over all turns after the first.

    python bench/agent_sessions.py --device cuda --json-out $OUT/agent-sessions.json  # 8B, H200
    python bench/agent_sessions.py --device cpu --small     # CPU scale (tiny random model)

The server runs as a subprocess on loopback (``python -m radixserve.launch_server``) over a
random-weight model of ``--shape`` written to a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from common import machine_info, write_json  # noqa: E402
from gpu_model import SHAPES, write_random_llama  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default=None, help="default: llama3-8b on cuda, tiny on cpu")
    p.add_argument("--attention", default=None, help="default: triton / torch_native")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--tool-tokens", type=int, default=2048)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--others", type=int, default=4, help="clients of unrelated traffic")
    p.add_argument("--other-prompt", type=int, default=2048)
    p.add_argument("--other-output", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool (server default)")
    p.add_argument("--session-pin-ratio", type=float, default=0.5)
    p.add_argument("--small", action="store_true", help="the CPU scale (see docs/benchmarks.md)")
    p.add_argument("--server-log", default=None)
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--rounds", type=int, default=1,
        help="phases off, on, off, on...: drift of a shared machine falls on both alike",
    )  # fmt: skip
    args = p.parse_args(argv)
    args.shape = args.shape or ("llama3-8b" if args.device == "cuda" else "tiny")
    args.attention = args.attention or ("triton" if args.device == "cuda" else "torch_native")
    if args.small:  # the sessions' contexts fit the pins; the others churn the whole pool
        args.sessions, args.turns, args.tool_tokens, args.user_tokens = 4, 6, 96, 8
        args.output, args.others, args.other_prompt, args.other_output = 8, 3, 768, 2
        args.max_total_tokens = args.max_total_tokens or 4096
        args.session_pin_ratio = 0.75
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, model_dir: Path, log: Path) -> tuple[Any, str]:
    port = free_port()
    context = args.turns * (args.tool_tokens + args.user_tokens + args.output) + 64
    context = max(context, args.other_prompt + args.other_output + 8)
    cmd = [
        sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1",
        "--port", str(port), "--model-path", str(model_dir),
        "--plugin", f"hardware={args.device}", "--plugin", f"attention={args.attention}",
        "--context-length", str(context), "--session-pin-ratio", str(args.session_pin_ratio),
    ]  # fmt: skip
    if args.max_total_tokens:
        cmd += ["--max-total-tokens", str(args.max_total_tokens)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not start in time")


async def stream_generate(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    """TTFT (s) of one streamed /generate, and its last event (cumulative output_ids)."""
    start = time.perf_counter()
    ttft, last = 0.0, {}
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            if ttft == 0.0:
                ttft = time.perf_counter() - start
            last = event
    return ttft, last


async def agent(
    client: httpx.AsyncClient, args: argparse.Namespace, index: int, sessions: bool, vocab: int
) -> list[tuple[float, int]]:
    """One agent's conversation; per turn (TTFT, cached tokens)."""
    rng = random.Random(1000 * index + (7 if sessions else 3))
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    sampling = {"max_new_tokens": args.output, "temperature": 0.0, "ignore_eos": True}
    sid = None
    if sessions:
        sid = (await client.post("/open_session", json={})).json()
    context: list[int] = []
    turns = []
    for _ in range(args.turns):
        new = draw(args.tool_tokens) + draw(args.user_tokens)
        body: dict[str, Any] = {"sampling_params": sampling}
        if sid is not None:
            body.update(input_ids=new, session_params={"id": sid})
        else:
            body["input_ids"] = context + new
        ttft, last = await stream_generate(client, body)
        turns.append((ttft, int(last["meta_info"]["cached_tokens"])))
        context += new + list(last["output_ids"])
    if sid is not None:
        await client.post("/close_session", json={"session_id": sid})
    return turns


async def other_client(
    client: httpx.AsyncClient, args: argparse.Namespace, seed: int, stop: asyncio.Event, vocab: int
) -> int:
    rng = random.Random(seed)
    sampling = {"max_new_tokens": args.other_output, "temperature": 0.0, "ignore_eos": True}
    sent = 0
    while not stop.is_set():
        prompt = [rng.randrange(3, vocab) for _ in range(args.other_prompt)]
        await stream_generate(client, {"input_ids": prompt, "sampling_params": sampling})
        sent += 1
    return sent


async def phase(url: str, args: argparse.Namespace, sessions: bool, vocab: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.sessions + args.others + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        await client.post("/flush_cache")
        stop = asyncio.Event()
        others = [
            asyncio.create_task(other_client(client, args, 10_000 + i, stop, vocab))
            for i in range(args.others)
        ]
        start = time.perf_counter()
        agents = await asyncio.gather(
            *(agent(client, args, i, sessions, vocab) for i in range(args.sessions))
        )
        elapsed = time.perf_counter() - start
        stop.set()
        other_requests = sum(await asyncio.gather(*others))
    return summarize(agents, elapsed, other_requests)


def merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds as one: their agents' turns together."""
    agents = [a for r in rounds for a in r["agents"]]
    seconds = sum(r["seconds"] for r in rounds)
    return summarize(agents, seconds, sum(r["other_requests"] for r in rounds))


def summarize(agents: list[list[tuple[float, int]]], elapsed: float, others: int) -> dict[str, Any]:
    turns = len(agents[0])
    per_turn = []
    for t in range(turns):
        ttfts = np.array([a[t][0] for a in agents]) * 1000
        cached = [a[t][1] for a in agents]
        per_turn.append({
            "turn": t + 1, "ttft_p50_ms": float(np.percentile(ttfts, 50)),
            "ttft_p99_ms": float(np.percentile(ttfts, 99)), "cached_mean": float(np.mean(cached)),
        })  # fmt: skip
    later = np.array([a[t][0] for a in agents for t in range(1, turns)]) * 1000
    return {
        "agents": agents,
        "per_turn": per_turn,
        "later_turns_ttft_p50_ms": float(np.percentile(later, 50)) if later.size else 0.0,
        "later_turns_ttft_p99_ms": float(np.percentile(later, 99)) if later.size else 0.0,
        "seconds": elapsed,
        "other_requests": others,
    }


def print_table(results: dict[str, dict[str, Any]]) -> None:
    off, on = results["off"], results["on"]
    print("turn | off p50 ms | off p99 ms | off cached | on p50 ms | on p99 ms | on cached")
    for a, b in zip(off["per_turn"], on["per_turn"], strict=True):
        print(
            f"{a['turn']:4d} | {a['ttft_p50_ms']:10.1f} | {a['ttft_p99_ms']:10.1f} | "
            f"{a['cached_mean']:10.0f} | {b['ttft_p50_ms']:9.1f} | {b['ttft_p99_ms']:9.1f} | "
            f"{b['cached_mean']:9.0f}"
        )
    for name in ("off", "on"):
        r = results[name]
        print(
            f"sessions {name}: turns 2.. TTFT p50 {r['later_turns_ttft_p50_ms']:.1f} ms, "
            f"p99 {r['later_turns_ttft_p99_ms']:.1f} ms; {r['seconds']:.1f} s, "
            f"{r['other_requests']} other requests"
        )
    ratio = off["later_turns_ttft_p50_ms"] / max(on["later_turns_ttft_p50_ms"], 1e-9)
    print(f"TTFT p50 (turns 2..), off / on: {ratio:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = SHAPES[args.shape]["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_random_llama(model_dir, args.shape, "cuda" if args.device == "cuda" else "cpu")
        log = Path(args.server_log) if args.server_log else Path(tmp) / "server.log"
        proc, url = start_server(args, model_dir, log)
        try:
            runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
            for _ in range(args.rounds):
                for name in ("off", "on"):
                    runs[name].append(asyncio.run(phase(url, args, name == "on", vocab)))
            results = {name: merge(r) for name, r in runs.items()}
            info = httpx.get(url + "/get_server_info", timeout=60).json()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print_table(results)
    if args.json_out:
        settings = {k: v for k, v in vars(args).items() if k != "json_out"}
        extra = {"sessions": info.get("sessions"), "kv_size": info.get("max_total_num_tokens")}
        write_json(args.json_out, {"machine": machine_info(), "args": settings,
                                   "results": results, "server": extra})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
