#!/usr/bin/env python
"""Issue 24 on one GPU in one run: ``radixserve serve`` given nothing but the model path,
measured with bench/serving.py, against the tuned offline Engine on the same prompts; then the
batch-64 workload on engines with no tuning flags and tuned ones, alternating (A-B-A-B).

In order: a random-weight SmolLM2-shape model directory (bench/gpu_model.py); the server,
started as ``radixserve serve --model-path DIR --host 127.0.0.1 --port P`` and nothing else,
warmed up with one serving run of the same shape (other prompts, outputs cut to 1/8), then
measured: 512 prompts of 1,024 tokens, 256 output tokens, concurrency 256, streaming, through
the native ``/generate`` (what SGLang's bench_serving uses for SGLang by default); the server
stopped; the offline Engine with bench/gpu.py's tuning flags (``tuned_engine``) warmed up and
measured on the very same two prompt sets; last, the 64 x (1,024 + 256) workload on a fresh
tuned engine, a fresh engine with no flags (``defaults_engine``), then both once more, each
timed twice after its warm-up (bench/gpu.py's ``warm_and_time``). Rates are output tokens over
wall time, prefill included, EOS ignored. No grammar plugin is named anywhere: where no grammar
package is installed (the GPU image has none) the platform's default grammar backend is none.

Where the time goes, beside the rates: the engine steps each timed run took (serving reads
``num_steps`` from /server_info) and so its milliseconds per step, and how busy each server
process was (CPU seconds over wall seconds, from /proc: near 1.0, a process that the others
wait for). ``--profile`` adds, last, the serving run once more with cProfile in the server's
HTTP and engine processes (bench/serve_cprofile.py); each process's busiest functions are
printed and the pstats files kept beside the JSON (``profile/``).

Device command (one call, in the repo root, carrying ``.whl``: the wheels the GPU image lacks;
tools/install_wheels.py installs only those, so none shadows the image's torch stack):

    python3 tools/install_wheels.py .whl /tmp/site && export PYTHONPATH=/tmp/site \
PYTHONUNBUFFERED=1 && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
>/dev/null 2>&1; set -o pipefail; python3 bench/gpu_serving.py --json-out $OUT/serving.json \
2>&1 | tee $OUT/serving.log

Smoke test on a CPU machine (tiny shape, a few short prompts, the cpu platform):

    .venv/bin/python bench/gpu_serving.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import io
import os
import pstats
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import serve_cprofile
import serving
import torch
from common import format_table, machine_info, write_json
from gpu import (
    StepStats,
    add_tuning_flags,
    bench_host,
    defaults_engine,
    phase,
    prompts,
    run_generate,
    tuned_engine,
    warm_and_time,
)
from gpu_model import SHAPES, write_random_llama

# Versions worth seeing next to a number: the serving stack, most of it carried as wheels.
STACK = ("torch", "triton", "transformers", "fastapi", "starlette", "uvicorn", "h11", "pydantic",
         "pyzmq", "msgspec", "httpx", "anyio", "typing_extensions")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--ab-requests", type=int, default=64, help="requests of the A-B workload")
    p.add_argument("--ab-rounds", type=int, default=2, help="tuned, defaults: this many times")
    p.add_argument("--target", type=float, default=0.9, help="serving / offline tuned, at least")
    p.add_argument("--server-timeout", type=float, default=420.0, help="seconds to get ready")
    p.add_argument("--skip-ab", action="store_true")
    p.add_argument("--skip-offline", action="store_true", help="the server's run only")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag added to the server's command (repeatable; --server-arg=--flag): to test a "
        "hypothesis, never part of the no-flags measurement",
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for the server (repeatable): to test a hypothesis, "
        "never part of the no-flags measurement",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="last, the serving run again with cProfile in the server's processes",
    )
    p.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="bench/serving.py's client processes (default: its own, one per 64 streams)",
    )
    p.add_argument("--workdir", default=None, help="where the model directory is written")
    p.add_argument("--json-out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shape, few short prompts, cpu")
    add_tuning_flags(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.num_prompts, args.input_len, args.output_len = "tiny", 8, 64, 16
        args.max_concurrency, args.ab_requests = 4, 4
        args.hardware, args.attention = "cpu", "torch_native"
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command() -> list[str]:
    """The ``radixserve`` script the editable install wrote (else the same ``main`` run as a
    module: both are the command a user types)."""
    beside = Path(sysconfig.get_path("scripts")) / "radixserve"
    found = str(beside) if beside.exists() else shutil.which("radixserve")
    return [found] if found else [sys.executable, "-m", "radixserve.entrypoints.cli"]


def check_installed() -> None:
    """The server finds its platforms and models through entry points: without the editable
    install it could not start. Fail here, in a second, rather than at the server's start."""
    names = {ep.name for ep in importlib.metadata.entry_points(group="radixserve")}
    missing = {"cpu", "cuda", "triton", "torch_native", "llama", "grammar_none"} - names
    if missing:
        sys.exit(f"error: radixserve's entry points {sorted(missing)} are not registered; "
                 "run `pip install --no-deps --no-build-isolation -e .` first")  # fmt: skip


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in STACK:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def serving_args(args: argparse.Namespace, url: str, seed: int, output_len: int) -> Any:
    vocab = SHAPES[args.shape]["vocab_size"]  # given, so the offline run can draw the same ids
    return serving.parse_args([
        "--base-url", url, "--backend", "native", "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(output_len),
        "--max-concurrency", str(args.max_concurrency), "--vocab-size", str(vocab),
        "--seed", str(seed), "--disable-tqdm",
        *(["--client-processes", str(args.client_processes)] if args.client_processes else []),
    ])  # fmt: skip


def prompt_ids(args: argparse.Namespace, seed: int, output_len: int) -> list[list[int]]:
    """The token ids bench/serving.py sends with these settings."""
    sent = serving_args(args, "", seed, output_len)
    return [r.input_ids for r in serving.make_requests(sent, SHAPES[args.shape]["vocab_size"])]


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc), None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, tuple[str, float]]:
    """{thread id: (its name, user + system CPU seconds so far)} of process ``pid``'s threads."""
    out = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            head, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        out[stat.parent.name] = (head.split("(", 1)[1], seconds)
    return out


def busiest_threads(
    before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]], wall: float
) -> dict[str, Any]:
    """How many threads the process had, how many of them used the CPU, and the busiest ones
    (name, CPU seconds over wall seconds): which threads beside the main one burn cores."""
    used = sorted(
        ((after[t][1] - before.get(t, ("", 0.0))[1]) / wall, after[t][0], t) for t in after
    )[::-1]
    return {
        "threads": len(after),
        "busy_threads": sum(1 for share, _, _ in used if share >= 0.01),
        "top": [[name, tid, round(share, 3)] for share, name, tid in used[:8]],
    }


def server_processes(pid: int) -> dict[str, int]:
    """The server's HTTP process and its children (the engine process among them), by name."""
    found = {"http": pid}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if int(rest.split()[1]) == pid:
            child = int(stat.parent.name)
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            # multiprocessing's spawned children: the engine; its resource tracker is not one
            kind = "engine" if "spawn_main" in cmdline else f"other:{child}"
            found[kind] = child
    return found


def cpu_snapshot(procs: dict[str, int]) -> dict[str, float | None]:
    return {name: process_cpu_seconds(pid) for name, pid in procs.items()}


def busy_fractions(
    before: dict[str, float | None], after: dict[str, float | None], wall: float
) -> dict[str, float]:
    """CPU seconds each process spent over ``wall`` seconds: 1.0 is one core always busy, so
    a process near 1.0 is what the others wait for (Python runs on one core)."""
    out = {}
    for name, start in before.items():
        end = after.get(name)
        if start is not None and end is not None:
            out[name] = round((end - start) / wall, 3)
    return out


def kind_breakdown(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Per step kind (decode-only: a CUDA graph's; mixed and prefill-only: eager), over a run
    (the engine's counters after minus before): steps, their share of the run's step time,
    ms per step, decodes and prefill tokens per step."""
    diff = {
        kind: {k: after[kind][k] - before.get(kind, {}).get(k, 0) for k in after[kind]}
        for kind in after
    }
    total = sum(d["seconds"] for d in diff.values()) or 1.0
    out = {}
    for kind, d in diff.items():
        n = d["steps"] or 1
        out[kind] = {
            "steps": int(d["steps"]),
            "time_share": round(d["seconds"] / total, 3),
            "ms_per_step": round(1000 * d["seconds"] / n, 3),
            "decodes_per_step": round(d["decodes"] / n, 1),
            "prefill_tokens_per_step": round(d["prefill_tokens"] / n, 1),
        }
    return out


class Timeline:
    """/server_info polled every ``period`` seconds in a thread during a run: requests live in
    the HTTP process, running and waiting in the engine, steps, and seconds with a step in
    flight; ``windows`` sums them up per slice of the run (when the engine idles, and why)."""

    def __init__(self, url: str, period: float = 0.1) -> None:
        self.url, self.period = url, period
        self.samples: list[tuple[float, int, int, int, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(30)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                info = client.get("/server_info").json()
                stepping = sum(k["seconds"] for k in info.get("steps_by_kind", {}).values())
                self.samples.append((time.perf_counter(), info["num_live_requests"],
                                     info["num_running_reqs"], info["num_waiting_reqs"],
                                     info["num_steps"], stepping))  # fmt: skip
                self._stop.wait(self.period)

    def windows(self, width: float = 0.25) -> list[list[Any]]:
        """[t, live, running, waiting, steps, share of the slice with a step in flight] per
        ``width`` seconds, from the first sample with a live request to the last."""
        busy = [i for i, x in enumerate(self.samples) if x[1] > 0]
        if not busy:
            return []
        first, last = max(busy[0] - 1, 0), min(busy[-1] + 1, len(self.samples) - 1)
        samples, t0 = self.samples[first : last + 1], self.samples[first][0]
        rows, prev = [], samples[0]
        for x in samples[1:]:
            if x[0] - prev[0] < width and x is not samples[-1]:
                continue
            dt = x[0] - prev[0]
            rows.append([round(x[0] - t0, 2), x[1], x[2], x[3], x[4] - prev[4],
                         round((x[5] - prev[5]) / dt, 2)])  # fmt: skip
            prev = x
        return rows


def offline_kinds(engine: Any) -> dict[str, dict[str, float]]:
    return {k: v.to_json() for k, v in engine.core.scheduler.stats.by_kind.items()}


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s (log: {log})")


def stop_server(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM: the server drains and stops its engine process (freeing the GPU)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    return proc.returncode


def run_server(
    model_dir: Path, args: argparse.Namespace, log: Path, profile_dir: Path | None = None
) -> dict[str, Any]:
    """The server with no flag but the model path (and where to listen), measured. With
    ``profile_dir`` both of its processes run under cProfile (bench/serve_cprofile.py)."""
    res: dict[str, Any] = {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    wrapper = [sys.executable, str(Path(__file__).parent / "serve_cprofile.py")]
    cmd = [*(wrapper if profile_dir else server_command()), "serve", "--model-path", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *args.server_arg]
    res["server_command"] = " ".join(cmd)
    print(f"  {res['server_command']}  (log: {log})", flush=True)
    # the smoke run shares a small CPU machine: one intra-op thread (not a server flag)
    env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if args.smoke else {})}
    env.update(kv.split("=", 1) for kv in args.server_env)
    if args.server_env:
        res["server_env"] = list(args.server_env)
        print(f"  server environment (a test, not the default): {args.server_env}", flush=True)
    if profile_dir is not None:
        env[serve_cprofile.PROFILE_DIR_ENV] = str(profile_dir)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        res["server_ready_s"] = wait_healthy(proc, url, log, args.server_timeout)
        print(f"  healthy after {res['server_ready_s']:.1f} s", flush=True)
        info = httpx.get(url + "/server_info", timeout=30).json()
        res["server_settings"] = info.get("engine_settings")
        res["server_plugins"] = info.get("active_plugins")
        res["server_kv_tokens"] = info.get("max_total_num_tokens")
        print(f"  plugins {res['server_plugins']}, KV pool {res['server_kv_tokens']} tokens")
        print(f"  settings {res['server_settings']}", flush=True)
        warm_len = max(args.output_len // 8, 2)
        warm = asyncio.run(serving.run(serving_args(args, url, 1, warm_len)))
        res["serving_warmup_failed"] = warm["failed"]
        print(f"  warm-up: {warm['completed']} requests, {warm['failed']} failed", flush=True)
        procs = server_processes(proc.pid)
        engine = procs.get("engine", proc.pid)
        info_before = httpx.get(url + "/server_info", timeout=30).json()
        steps_before = info_before.get("num_steps")
        threads_before = thread_cpu_seconds(engine)
        cpu_before = cpu_snapshot(procs)
        with Timeline(url) as timeline:
            summary = asyncio.run(serving.run(serving_args(args, url, 0, args.output_len)))
        res["serving_timeline"] = timeline.windows()
        print("  timeline [t s, live (HTTP), running, waiting (engine), steps, stepping share]:")
        for row in res["serving_timeline"]:
            print(f"    {row}")
        res["serving_client_busy"] = summary.get("client_processes_busy")
        print(f"  client processes busy (CPU s / wall s): {res['serving_client_busy']}")
        # Over the timed run (the client's first send to its last end), not this call's wall
        # time, which adds ~3 s of client start-up while the server idles.
        wall = summary["duration_s"]
        res["serving_process_busy"] = busy_fractions(cpu_before, cpu_snapshot(procs), wall)
        threads = busiest_threads(threads_before, thread_cpu_seconds(engine), wall)
        res["serving_engine_threads"] = threads
        print(f"  engine process threads: {threads}", flush=True)
        info_after = httpx.get(url + "/server_info", timeout=30).json()
        steps_after = info_after.get("num_steps")
        if info_after.get("gc") and info_before.get("gc"):
            res["serving_gc"] = {
                proc: {
                    "collections": [a - b for a, b in zip(after["collections"],
                                    info_before["gc"][proc]["collections"], strict=True)],
                    "seconds": [round(a - b, 4) for a, b in zip(after["seconds"],
                                info_before["gc"][proc]["seconds"], strict=True)],
                }
                for proc, after in info_after["gc"].items()
            }  # fmt: skip
            print(f"  garbage collections in the run, per generation: {res['serving_gc']}")
        if info_after.get("steps_by_kind"):
            kinds = kind_breakdown(info_before["steps_by_kind"], info_after["steps_by_kind"])
            res["serving_step_kinds"] = kinds
            stepping = sum(
                after["seconds"] - info_before["steps_by_kind"][kind]["seconds"]
                for kind, after in info_after["steps_by_kind"].items()
            )
            res["serving_stepping_share"] = round(stepping / summary["duration_s"], 3)
            print(f"  serve steps by kind: {kinds}; stepping {stepping:.2f} s of the run's "
                  f"{summary['duration_s']:.2f} s", flush=True)  # fmt: skip
        if steps_before is not None and steps_after is not None:
            res["serving_steps"] = steps_after - steps_before
            res["serving_ms_per_step"] = 1000 * summary["duration_s"] / res["serving_steps"]
        serving.print_summary(summary)
        print(f"  busy (CPU s / wall s): {res['serving_process_busy']}; engine steps "
              f"{res.get('serving_steps')}, {res.get('serving_ms_per_step', 0):.2f} ms each",
              flush=True)  # fmt: skip
        res["serving"] = summary
        if summary["failed"] == 0:  # a rate over fewer requests would not be this workload's
            res["serving_tok_s"] = summary["output_throughput"]
    finally:
        res["server_exit_code"] = stop_server(proc)
        banner = [line for line in log.read_text(errors="replace").splitlines()
                  if line.startswith("radixserve: ")]  # fmt: skip
        res["server_banner"] = banner[:4]
    return res


def run_profiled_server(
    model_dir: Path, args: argparse.Namespace, log: Path, profile_dir: Path
) -> dict[str, Any]:
    """The same serving run with cProfile in both server processes (slower: its rates are not
    the server's); prints each process's busiest functions, keeps the pstats files."""
    res = run_server(model_dir, args, log, profile_dir)
    out: dict[str, Any] = {
        f"profiled_{k}": v for k, v in res.items() if not k.startswith("server_")
    }
    for name in ("engine", "http"):
        path = profile_dir / f"{name}.pstats"
        if not path.exists():
            out[f"profiled_{name}_missing"] = str(path)
            continue
        text = io.StringIO()
        pstats.Stats(str(path), stream=text).sort_stats("tottime").print_stats(30)
        print(f"--- {name} process, by own time (top 30) ---\n{text.getvalue()}", flush=True)
        out[f"profiled_{name}_pstats"] = str(path)
    # one file to bring back (a device call returns a limited number of files)
    with tarfile.open(profile_dir.with_suffix(".tgz"), "w:gz") as tar:
        tar.add(profile_dir, arcname=profile_dir.name)
    shutil.rmtree(profile_dir)
    return out


def run_offline(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The tuned offline Engine on the prompts bench/serving.py sent: the same warm-up set at
    the same cut output length, then the timed set."""
    warm_len = max(args.output_len // 8, 2)
    workload = (args.num_prompts, args.input_len, args.output_len)
    start = time.perf_counter()
    engine = tuned_engine(model_dir, args, [workload], bench_host(StepStats()))
    try:
        res: dict[str, Any] = {"offline_start_s": time.perf_counter() - start}
        res["offline_settings"] = engine.core.runner.settings.describe()
        run_generate(engine, prompt_ids(args, 1, warm_len), warm_len)
        stats = engine.core.scheduler.stats
        steps_before, cpu_before = stats.steps, process_cpu_seconds(os.getpid())
        threads_before, kinds_before = thread_cpu_seconds(os.getpid()), offline_kinds(engine)
        seconds = run_generate(engine, prompt_ids(args, 0, args.output_len), args.output_len)
        res["offline_step_kinds"] = kind_breakdown(kinds_before, offline_kinds(engine))
        print(f"  offline steps by kind: {res['offline_step_kinds']}", flush=True)
        cpu_after = process_cpu_seconds(os.getpid())
        threads = busiest_threads(threads_before, thread_cpu_seconds(os.getpid()), seconds)
        res["offline_threads"] = threads
        print(f"  offline process threads: {threads}", flush=True)
        res["offline_tuned_tok_s"] = args.num_prompts * args.output_len / seconds
        res["offline_steps"] = stats.steps - steps_before
        res["offline_ms_per_step"] = 1000 * seconds / res["offline_steps"]
        if cpu_before is not None and cpu_after is not None:
            res["offline_process_busy"] = round((cpu_after - cpu_before) / seconds, 3)
        print(f"  offline tuned: {res['offline_tuned_tok_s']:.1f} tok/s, {res['offline_steps']} "
              f"steps, {res['offline_ms_per_step']:.2f} ms each, busy "
              f"{res.get('offline_process_busy')}", flush=True)  # fmt: skip
    finally:
        engine.shutdown()
    return res


def run_alternating(
    model_dir: Path, args: argparse.Namespace, res: dict[str, Any]
) -> dict[str, Any]:
    """Tuned, no flags, tuned, no flags ...: each a fresh engine (as bench/gpu.py builds them),
    warmed up, then timed twice on fresh prompts; the same prompts for both in a round."""
    workload = (args.ab_requests, args.input_len, args.output_len)
    n, i, o = workload
    vocab = SHAPES[args.shape]["vocab_size"]
    runs: list[dict[str, Any]] = res.setdefault("ab_runs", [])  # kept if a later one fails
    for rnd in range(args.ab_rounds):
        seed = 41 + 10 * rnd
        for mode in ("tuned", "defaults"):
            start = time.perf_counter()
            if mode == "tuned":
                engine = tuned_engine(model_dir, args, [workload], bench_host(StepStats()))
            else:
                engine = defaults_engine(model_dir)
            run: dict[str, Any] = {"round": rnd + 1, "mode": mode}
            run["start_s"] = time.perf_counter() - start
            try:
                run["settings"] = engine.core.runner.settings.describe()
                first = n * o / warm_and_time(engine, workload, vocab, seed)
                second = n * o / run_generate(engine, prompts(n, i, vocab, seed + 1), o)
                run["tok_s"] = [first, second]
            finally:
                engine.shutdown()
                del engine
                free_device_memory()
            runs.append(run)
            print(f"  round {rnd + 1} {mode}: {first:.1f}, {second:.1f} tok/s", flush=True)
    rates = {m: [x for run in runs if run["mode"] == m for x in run["tok_s"]]
             for m in ("tuned", "defaults")}  # fmt: skip
    return {
        "ab_workload": list(workload),
        "ab_tuned_tok_s": rates["tuned"],
        "ab_defaults_tok_s": rates["defaults"],
        "ab_ratio_of_medians": statistics.median(rates["defaults"])
        / statistics.median(rates["tuned"]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_installed()
    # a `timeout` around this script: stop the server on the way out (the finally blocks),
    # rather than leave it holding the GPU for whatever runs next
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    begin = time.perf_counter()
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info(), "versions": versions()}
    out = args.json_out
    if torch.cuda.is_available():
        res["gpu"] = torch.cuda.get_device_name()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rs-gpu-serving-"))
    model_dir = workdir / args.shape
    log = Path(out).with_suffix(".server.log") if out else workdir / "server.log"
    # Written on the CPU: this process holds no GPU memory while the server sizes its KV pool.
    write = lambda: {"weight_bytes": write_random_llama(model_dir, args.shape, "cpu")}
    steps = [("model", write), ("serving", lambda: run_server(model_dir, args, log)),
             ("offline", lambda: run_offline(model_dir, args))]  # fmt: skip
    if args.skip_offline:
        steps.pop()
    if not args.skip_ab:
        steps.append(("alternating", lambda: run_alternating(model_dir, args, res)))
    if args.profile:
        prof_dir = Path(out).parent / "profile" if out else workdir / "profile"
        prof_log = log.with_name(log.name.replace(".server.log", ".profiled-server.log"))
        steps.append(("profiled", lambda: run_profiled_server(model_dir, args, prof_log, prof_dir)))
    for name, fn in steps:
        print(f"[{name}] at {time.perf_counter() - begin:.0f} s", flush=True)
        phase(res, name, fn, out)
        free_device_memory()
    res["wall_s"] = time.perf_counter() - begin
    report(res, args)
    if out:
        write_json(out, res)
    return 0 if not [k for k in res if k.endswith("_error")] else 1


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    if r.get("serving_tok_s") and r.get("offline_tuned_tok_s"):
        r["serving_over_offline"] = r["serving_tok_s"] / r["offline_tuned_tok_s"]
        r["serving_meets_target"] = r["serving_over_offline"] >= args.target
    shape = f"{args.num_prompts} x ({args.input_len} + {args.output_len})"
    flags = " ".join(args.server_arg + args.server_env) or "no flags"
    rows: list[list[Any]] = [
        [f"serve, {flags}: {shape}, c={args.max_concurrency}, stream, tok/s",
         r.get("serving_tok_s"), r.get("serving_over_offline"), f">= {args.target} of offline"],
        ["offline Engine, tuned flags, same prompts, tok/s", r.get("offline_tuned_tok_s"), None,
         None],
    ]  # fmt: skip
    rows += [
        ["engine steps of the timed run: serve / offline", f"{r.get('serving_steps')} / "
         f"{r.get('offline_steps')}", None, None],
        ["ms per engine step: serve / offline", f"{r.get('serving_ms_per_step') or 0:.2f} / "
         f"{r.get('offline_ms_per_step') or 0:.2f}", None, None],
        ["busy (CPU s / wall s): serve's processes; offline", str(r.get("serving_process_busy")),
         r.get("offline_process_busy"), None],
    ]  # fmt: skip
    for run in ("serving", "offline"):
        for kind, k in (r.get(f"{run}_step_kinds") or {}).items():
            rows.append([f"{run} {kind} steps: n, ms each, decodes + prefill tokens each",
                         f"{k['steps']}, {k['ms_per_step']:.2f} ms, {k['decodes_per_step']:.0f} + "
                         f"{k['prefill_tokens_per_step']:.0f}", k["time_share"],
                         "share of step time"])  # fmt: skip
    for proc, counts in (r.get("serving_gc") or {}).items():
        rows.append([f"{proc} process: garbage collections per generation, seconds",
                     f"{counts['collections']}, {counts['seconds']}", None, None])  # fmt: skip
    if r.get("serving_client_busy"):
        rows.append(["client processes busy (CPU s / wall s)", str(r["serving_client_busy"]),
                     None, None])  # fmt: skip
    if r.get("serving_stepping_share") is not None:
        rows.append(["serve: seconds with a step in flight / run's seconds",
                     r["serving_stepping_share"], None, None])  # fmt: skip
    if r.get("serving", {}).get("ttft_median_ms_later") is not None:
        rows.append(["serving TTFT median, ms: first wave / later requests",
                     f"{r['serving']['ttft_median_ms_first_wave']:.1f} / "
                     f"{r['serving']['ttft_median_ms_later']:.1f}", None, None])  # fmt: skip
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms") if r.get("serving") else ():
        st = r["serving"][key]
        value = " / ".join(f"{st[k]:.1f}" for k in ("median", "p90", "p99"))
        rows.append([f"serving {key} median / p90 / p99", value, None, None])
    ab = f"{args.ab_requests} x ({args.input_len} + {args.output_len})"
    tuned = {run["round"]: run for run in r.get("ab_runs", []) if run["mode"] == "tuned"}
    for run in r.get("ab_runs", []):
        rates = " / ".join(f"{x:.1f}" for x in run.get("tok_s", []))
        base = tuned.get(run["round"], {}).get("tok_s")
        rel = None
        if run["mode"] == "defaults" and base and run.get("tok_s"):
            rel = statistics.mean(run["tok_s"]) / statistics.mean(base)
        label = f"{ab} round {run['round']} {run['mode']}, tok/s (2 runs)"
        rows.append([label, rates, rel, ">= 0.95 of tuned" if rel else None])
    if r.get("ab_ratio_of_medians"):
        rows.append(["no flags / tuned, medians of all runs", None, r["ab_ratio_of_medians"],
                     ">= 0.95"])  # fmt: skip
    print(f"\nshape={args.shape} gpu={r.get('gpu')} wall={r.get('wall_s', 0):.0f} s")
    print(format_table(["measure", "value", "ratio", "target"], rows))
    for key in [k for k in r if k.endswith("_error")]:
        print(f"{key}: {r[key]}")


if __name__ == "__main__":
    sys.exit(main())
