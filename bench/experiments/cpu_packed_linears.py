"""Float32 linears on oneDNN's packed weights against MKL (issue 19): two engines of the default
model in one process, one with the CPU platform's packed linears (the default) and one with
them switched off, alternating round by round: offline greedy batches (the decode steps' median
time, and tokens per second including the prefill), plus the greedy agreement of the two.

    python bench/cpu_packed_linears.py
    python bench/cpu_packed_linears.py --batches 1 8 32 --rounds 3 --output-len 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tqdm import tqdm

from radixserve import Engine
from radixserve.plugins.hardware import cpu_linear
from radixserve.plugins.models.gguf_loader import convert_gguf_to_hf_dir, default_model_gguf_path


def engine(model: str, packed: bool) -> Engine:
    check = cpu_linear.packed_linears_unavailable
    if not packed:
        cpu_linear.packed_linears_unavailable = lambda *a: "switched off by the benchmark"
    try:
        return Engine(model, plugins=["hardware=cpu"])
    finally:
        cpu_linear.packed_linears_unavailable = check


def timed_steps(eng: Engine) -> list[float]:
    """Record the wall time of each decode-only forward of ``eng``."""
    step, times = eng.core.runner.step, []

    def timed(batch: Any) -> Any:
        start = time.perf_counter()
        out = step(batch)
        if batch.num_decode == batch.batch_size:
            times.append(time.perf_counter() - start)
        return out

    eng.core.runner.step = timed
    return times


def run(eng: Engine, times: list[float], prompts: list[str], n: int) -> tuple[float, float, list]:
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    times.clear()
    start = time.perf_counter()
    out = eng.generate(prompt=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    step_ms = statistics.median(times) * 1e3 if times else float("nan")
    return len(prompts) * n / seconds, step_ms, [o["output_ids"] for o in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    model = str(convert_gguf_to_hf_dir(default_model_gguf_path()))
    engines = {"packed": engine(model, True), "mkl": engine(model, False)}
    steps = {name: timed_steps(e) for name, e in engines.items()}
    header = ("batch", "packed step ms", "MKL step ms", "step ratio", "packed tok/s", "MKL tok/s",
              "tok/s ratio", "same outputs")  # fmt: skip
    print(" | ".join(header))
    try:
        for batch in args.batches:
            rates: dict[str, list[float]] = {name: [] for name in engines}
            step_ms: dict[str, list[float]] = {name: [] for name in engines}
            same = total = 0
            for r in tqdm(range(args.rounds), desc=f"batch {batch}", leave=False):
                # fresh prompts each round and engine: no prefix-cache hits across runs
                text = "tell me about the sea, the boats and the lighthouse of the harbour."
                prompts = [f"Round {r}, text {i}: {text}" for i in range(batch)]
                outs = {}
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for name in order:
                    tok_s, ms, outs[name] = run(
                        engines[name], steps[name], prompts, args.output_len
                    )
                    rates[name].append(tok_s)
                    step_ms[name].append(ms)
                same += sum(a == b for a, b in zip(outs["packed"], outs["mkl"], strict=True))
                total += batch
            pk, mk = (statistics.median(step_ms[n]) for n in ("packed", "mkl"))
            pr, mr = (statistics.median(rates[n]) for n in ("packed", "mkl"))
            print(f"{batch} | {pk:.1f} | {mk:.1f} | {mk / pk:.2f}x | {pr:.2f} | {mr:.2f} | "
                  f"{pr / mr:.2f}x | {same}/{total}")  # fmt: skip
    finally:
        for e in engines.values():
            e.shutdown()


if __name__ == "__main__":
    main()
