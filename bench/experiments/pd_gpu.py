#!/usr/bin/env python
"""Prefill/decode disaggregation on two GPUs of one host against one colocated GPU, in one run
(issue 16's H200 x2 measure): decode inter-token latency under a mixed workload, and greedy
outputs token for token.

In order: a random-weight model of a real shape (bench/gpu_model.py; default the Llama-3.1-8B
shape, bfloat16), written by a child process so that this one holds no GPU memory; then

(a) colocated: one ``radixserve serve`` on GPU 0;
(b) disaggregated: a prefill server on GPU 0 and a decode server on GPU 1 joined by the KV
    connector ``--backend`` (default ``nixl``: UCX, GPU to GPU); where its servers do not start
    or its first transfer fails, ``--fallback`` (default ``tcp``) is run instead and the JSON
    says why.

Each is measured behind bench/pd_proxy.py (what sglang-router sends in PD mode; for (a) a plain
forward, so both pay the same hop): a warm-up at the workload's lengths; ``--greedy`` prompts
one at a time (temperature 0, EOS ignored), whose output ids (a) and (b) must share; then the
mixed workload, streamed through the native ``/generate`` by bench/serving.py's client (its
ITL, TTFT and percentile code): ``--long`` prompts of ``--long-len`` tokens and ``--chat``
chat-like requests (``--chat-len`` in, ``--chat-out`` out), shuffled, arriving as a Poisson
process of ``--rate`` requests/s with a fixed seed (the same prompts and arrival times for (a)
and (b)). ITL is reported over all requests and over the chat-like ones alone: those are the
decodes a colocated server interrupts with 8k-token prefills.

Each server process sees both GPUs (``CUDA_VISIBLE_DEVICES=0,1`` or ``1,0``; it runs on its
first), so that UCX's cuda_ipc may map the peer GPU's memory.

Device command (nvidia-h200-x2; carries ``.whl`` and ``.whl-pd``, the stripped nixl-cu13 wheel):

    python3 tools/install_wheels.py .whl /tmp/site && python3 tools/install_wheels.py .whl-pd \
/tmp/site && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && python3 -m pip install -q \
--no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1; timeout 480 python3 \
bench/pd_gpu.py --workdir /tmp/models --json-out $OUT/pd.json 2>&1 | tee $OUT/pd.log | tail -60

``.whl-pd`` holds ``nixl_cu13-1.5.1-cp312`` from PyPI repacked without ``nixl_ep_cu13/`` (three
31 MB torch extensions for expert parallelism that the KV connector never imports): 29 MiB
instead of 56, so that it travels with ``.whl`` within a call's 64 MiB; ``python3
bench/nixl_wheel.py .whl-pd`` makes it. sglang-router (30.7 MB) does not fit beside it, hence
bench/pd_proxy.py.

Smoke test on a CPU machine (tiny shape, the cpu platform, tcp, small workload; ~1 min):

    .venv/bin/python bench/pd_gpu.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import serving
from common import format_table, machine_info, random_prompts, write_json
from gpu import phase
from gpu_model import SHAPES
from gpu_serving import check_installed, free_port, server_command, stop_server, wait_healthy

BENCH = Path(__file__).resolve().parent
GREEDY_TOKENS = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--backend", default=None, help="KV connector of the PD run (nixl; smoke: tcp)")
    p.add_argument("--fallback", default=None, help="connector when --backend fails ('': none)")
    p.add_argument("--long", type=int, default=16, help="long prompts in the workload")
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--long-out", type=int, default=64)
    p.add_argument("--chat", type=int, default=64, help="chat-like requests in the workload")
    p.add_argument("--chat-len", type=int, default=256)
    p.add_argument("--chat-out", type=int, default=128)
    p.add_argument("--rate", type=float, default=4.0, help="arrivals, requests/s (Poisson)")
    p.add_argument("--greedy", type=int, default=8, help="prompts compared token for token")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to get ready")
    p.add_argument("--transfer-timeout", type=float, default=60.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra flag, all servers")
    p.add_argument("--workdir", default=None, help="where the model directory is written")
    p.add_argument("--json-out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shape, cpu, tcp, small workload")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape = "tiny"
        args.backend, args.fallback = args.backend or "tcp", args.fallback or ""
        args.long, args.long_len, args.long_out = 2, 512, 8
        args.chat, args.chat_len, args.chat_out = 6, 32, 8
        args.rate, args.greedy = 8.0, 3
    args.backend = args.backend or "nixl"
    args.fallback = "tcp" if args.fallback is None else args.fallback
    return args


# ---- servers ---------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def start_server(
    args: argparse.Namespace,
    name: str,
    model_dir: Path,
    gpus: str,
    flags: list[str],
    logs: Path,
    tag: str = "",
) -> Server:
    port = free_port()
    cmd = [*server_command(), "serve", "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), *flags, *args.server_arg]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    if args.smoke:  # the smoke run shares a small CPU machine: one intra-op thread each
        env["OMP_NUM_THREADS"] = "1"
    log = logs / f"{tag}{name}.log"
    print(f"  {name}: CUDA_VISIBLE_DEVICES={gpus} {' '.join(cmd[1:])}", flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(name, f"http://127.0.0.1:{port}", proc, log)
    try:
        ready = wait_healthy(proc, server.url, log, args.server_timeout)
    except BaseException:
        stop_server(proc)
        raise
    print(f"  {name} healthy after {ready:.1f} s", flush=True)
    return server


@contextlib.contextmanager
def servers(
    args: argparse.Namespace, model_dir: Path, backend: str | None, logs: Path
) -> Iterator[tuple[list[Server], str]]:
    """The colocated server (``backend`` None) or a prefill + decode pair, started side by
    side, with the proxy in front; yields (servers, proxy URL)."""
    if backend is None:
        specs = [("colocated", "0,1", [])]
        bootstrap = None
    else:
        bootstrap = free_port()
        common = ["--disaggregation-transfer-backend", backend,
                  "--disaggregation-transfer-timeout", str(args.transfer_timeout)]  # fmt: skip
        specs = [
            ("prefill", "0,1", ["--disaggregation-mode", "prefill",
                                "--disaggregation-bootstrap-port", str(bootstrap), *common]),
            ("decode", "1,0", ["--disaggregation-mode", "decode", *common]),
        ]  # fmt: skip
    started: list[Server] = []
    tag = f"{backend}-" if backend else ""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_server, args, n, model_dir, g, f, logs, tag)
                   for n, g, f in specs]  # fmt: skip
        errors = []
        for future in futures:
            try:
                started.append(future.result())
            except Exception as e:  # noqa: BLE001 - the others are stopped, then it is raised
                errors.append(e)
    proxy = None
    try:
        if errors:
            raise errors[0]
        port = free_port()
        cmd = [sys.executable, str(BENCH / "pd_proxy.py"), "--port", str(port),
               "--decode", started[-1].url]  # fmt: skip
        if backend is not None:
            cmd += ["--prefill", started[0].url, "--bootstrap-port", str(bootstrap)]
        with open(logs / f"{tag}proxy.log", "ab") as out:
            proxy = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proxy, url, logs / f"{tag}proxy.log", 60)
        yield started, url
    finally:
        if proxy is not None:
            stop_server(proxy)
        with ThreadPoolExecutor(max(1, len(started))) as pool:
            list(pool.map(lambda s: stop_server(s.proc), started))


# ---- workload --------------------------------------------------------------------------------


def prompts_of(args: argparse.Namespace, num: int, length: int, seed: int) -> list[list[int]]:
    vocab = SHAPES[args.shape]["vocab_size"]
    return random_prompts(num, length, vocab, set(range(min(100, vocab // 2))), seed)


def workload(args: argparse.Namespace, seed: int, out_scale: float = 1.0) -> list[Any]:
    """The mixed requests, shuffled: (bench/serving.py Request, kind)."""
    long_out = max(2, int(args.long_out * out_scale))
    chat_out = max(2, int(args.chat_out * out_scale))
    reqs = [
        (serving.Request(ids, long_out), "long")
        for ids in prompts_of(args, args.long, args.long_len, seed)
    ]
    reqs += [(serving.Request(ids, chat_out), "chat")
             for ids in prompts_of(args, args.chat, args.chat_len, seed + 1)]  # fmt: skip
    random.Random(seed).shuffle(reqs)
    return reqs


def client_args(args: argparse.Namespace, url: str, rate: float) -> argparse.Namespace:
    return serving.parse_args([
        "--base-url", url, "--backend", "native", "--request-rate", str(rate),
        "--vocab-size", str(SHAPES[args.shape]["vocab_size"]), "--seed", "0", "--disable-tqdm",
    ])  # fmt: skip


def run_workload(
    args: argparse.Namespace, url: str, seed: int, scale: float, rate: float
) -> dict[str, Any]:
    """Send the mixed workload; summaries over all requests and per kind (bench/serving.py)."""
    sent = workload(args, seed, scale)
    cargs = client_args(args, url, rate)
    reqs = [r for r, _ in sent]
    results, start, end = asyncio.run(serving._send_all(cargs, "default", reqs, len(reqs)))
    out: dict[str, Any] = {"all": serving.summarize(cargs, results, end - start, "default")}
    for kind in ("chat", "long"):
        part = [res for res, (_, k) in zip(results, sent, strict=True) if k == kind]
        out[kind] = serving.summarize(cargs, part, end - start, "default")
    return out


def greedy_outputs(args: argparse.Namespace, url: str) -> list[list[int] | str]:
    """Output ids of ``--greedy`` fresh prompts (a quarter long), one at a time."""
    n_long = max(1, args.greedy // 4)
    ids = prompts_of(args, n_long, args.long_len, 901)
    ids += prompts_of(args, args.greedy - n_long, args.chat_len, 902)
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": GREEDY_TOKENS}
    outs: list[list[int] | str] = []
    with httpx.Client(base_url=url, timeout=args.transfer_timeout + 120) as client:
        for prompt in ids:
            resp = client.post("/generate", json={"input_ids": prompt, "sampling_params": params})
            outs.append(resp.json()["output_ids"] if resp.status_code == 200
                        else f"HTTP {resp.status_code}: {resp.text[:300]}")  # fmt: skip
    return outs


def probe(url: str, args: argparse.Namespace) -> str | None:
    """One short request through the proxy: None when it completes, else why not."""
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": prompts_of(args, 1, 64, 7)[0], "sampling_params": params}
    try:
        resp = httpx.post(url + "/generate", json=body, timeout=args.transfer_timeout + 30)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:500]}"
    return None


def measure(args: argparse.Namespace, url: str, label: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    start = time.perf_counter()
    # other prompts, outputs cut short, all at once (every batch size gets its graphs)
    warm = run_workload(args, url, 500, 1 / 8, float("inf"))
    res["warmup_failed"] = warm["all"]["failed"]
    res["warmup_s"] = time.perf_counter() - start
    print(f"  [{label}] warm-up: {warm['all']['completed']} done, {warm['all']['failed']} "
          f"failed, {res['warmup_s']:.1f} s", flush=True)  # fmt: skip
    res["greedy"] = greedy_outputs(args, url)
    res["workload"] = run_workload(args, url, 0, 1.0, args.rate)
    res["proxy"] = httpx.get(url + "/pd_stats", timeout=10).json()
    for kind in ("all", "chat", "long"):
        s = res["workload"][kind]
        itl, ttft = s["itl_ms"], s["ttft_ms"]
        print(f"  [{label}] {kind}: {s['completed']}/{s['num_prompts']} done, ITL p50 "
              f"{itl['median']:.2f} p99 {itl['p99']:.2f} ms, TTFT p50 {ttft['median']:.1f} ms, "
              f"{s['output_throughput']:.1f} tok/s", flush=True)  # fmt: skip
    return res


# ---- phases ----------------------------------------------------------------------------------


def write_model(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """In a child process (on a GPU where there is one, then gone with its memory). A complete
    directory of the shape already there (bench/tp.py's, on a machine still warm) is reused:
    the same function and seed write the same weights."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        total = json.loads(index.read_text())["metadata"]["total_size"]
        return {"weight_bytes": total, "model_reused": True}
    code = (
        f"import sys, torch; sys.path.insert(0, {str(BENCH.parent)!r}); from pathlib import Path; "
        "from gpu_model import write_random_llama; "
        "dev = 'cuda' if torch.cuda.is_available() else 'cpu'; "
        f"print(write_random_llama(Path({str(model_dir)!r}), {args.shape!r}, dev))"
    )  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"writing the model failed: {done.stderr[-2000:]}")
    return {"weight_bytes": int(done.stdout.split()[-1]), "model_s": time.perf_counter() - start}


def run_colocated(args: argparse.Namespace, model_dir: Path, logs: Path) -> dict[str, Any]:
    with servers(args, model_dir, None, logs) as (_, url):
        return {"colocated": measure(args, url, "colocated")}


def run_pd(args: argparse.Namespace, model_dir: Path, logs: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"pd_attempts": []}
    for backend in [b for b in (args.backend, args.fallback) if b]:
        attempt: dict[str, Any] = {"backend": backend}
        res["pd_attempts"].append(attempt)
        try:
            with servers(args, model_dir, backend, logs) as (_, url):
                attempt["probe_error"] = problem = probe(url, args)
                if problem is not None:
                    print(f"  {backend}: the first transfer failed: {problem}", flush=True)
                    continue
                res["pd_backend"] = backend
                res["pd"] = measure(args, url, f"pd {backend}")
                return res
        except Exception as e:  # noqa: BLE001 - recorded; the fallback runs next
            attempt["error"] = f"{type(e).__name__}: {e}"[:3000]
            print(f"  {backend}: {attempt['error'][:1500]}", flush=True)
    raise RuntimeError(f"no connector worked: {res['pd_attempts']}")


def compare(res: dict[str, Any]) -> dict[str, Any]:
    a, b = res.get("colocated", {}).get("greedy"), res.get("pd", {}).get("greedy")
    if not a or not b:
        return {}
    same = [x == y and isinstance(x, list) for x, y in zip(a, b, strict=True)]
    # where each differing pair first differs (token index)
    diverge = [next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                    min(len(x), len(y)))
               for x, y in zip(a, b, strict=True)
               if isinstance(x, list) and isinstance(y, list) and x != y]  # fmt: skip
    return {"greedy_identical": sum(same), "greedy_prompts": len(same),
            "greedy_diverge_at": diverge}  # fmt: skip


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    rows: list[list[Any]] = []
    for key, label in (("colocated", "colocated, 1 GPU"),
                       ("pd", f"PD {res.get('pd_backend')}, 2 GPUs")):  # fmt: skip
        w = res.get(key, {}).get("workload")
        if not w:
            continue
        for kind in ("chat", "all", "long"):
            s = w[kind]
            rows.append([label, kind, f"{s['completed']}/{s['num_prompts']}",
                         s["itl_ms"]["median"], s["itl_ms"]["p99"], s["ttft_ms"]["median"],
                         s["ttft_ms"]["p99"], s["output_throughput"]])  # fmt: skip
    print(f"\nshape={args.shape}  workload: {args.long} x ({args.long_len} + {args.long_out}) and "
          f"{args.chat} x ({args.chat_len} + {args.chat_out}), {args.rate} req/s  "
          f"wall={res.get('wall_s', 0):.0f} s")  # fmt: skip
    headers = ["run", "requests", "done", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms",
               "TTFT p99 ms", "output tok/s"]  # fmt: skip
    print(format_table(headers, rows))
    if "greedy_prompts" in res:
        print(f"greedy outputs identical: {res['greedy_identical']}/{res['greedy_prompts']} "
              f"prompts x {GREEDY_TOKENS} tokens")  # fmt: skip
    for key in [k for k in res if k.endswith("_error")]:
        print(f"{key}: {res[key][:1500]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_installed()
    begin = time.perf_counter()
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    out = args.json_out
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-pd-"))
    logs = workdir / "logs"  # their tails go into the JSON (a device call returns 8 files)
    logs.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / args.shape
    steps = [("model", lambda: write_model(args, model_dir)),
             ("colocated", lambda: run_colocated(args, model_dir, logs)),
             ("pd", lambda: run_pd(args, model_dir, logs))]  # fmt: skip
    for name, fn in steps:
        print(f"[{name}] at {time.perf_counter() - begin:.0f} s", flush=True)
        phase(res, name, fn, out)
        if name == "model" and "model_error" in res:
            break
    res.update(compare(res))
    res["wall_s"] = time.perf_counter() - begin
    res["log_tails"] = {f.name: f.read_text(errors="replace")[-2000:]
                        for f in sorted(logs.glob("*.log"))}  # fmt: skip
    report(res, args)
    if out:
        write_json(out, res)
    ok = res.get("greedy_identical") == res.get("greedy_prompts", -1)
    return 0 if ok and not [k for k in res if k.endswith("_error")] else 1


if __name__ == "__main__":
    sys.exit(main())
