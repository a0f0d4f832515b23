#!/usr/bin/env python
"""CPU decode attention: the ``cpu_paged`` C++ kernel (the CPU default) against torch_native's
gather + SDPA, end to end on the default model (issue 19).

Two engines in this process, one per backend, float32 with no other flags; at each batch size,
rounds alternate which engine goes first. A round sends ``batch`` fresh random prompts of
``--input-len`` tokens and decodes ``--output-len`` greedy tokens each; decode throughput is
timed from the step hook (decode-only steps), so prefill does not blur the attention's share.
Greedy outputs of the two engines are compared token for token.

    .venv/bin/python bench/cpu_paged_attention.py
    .venv/bin/python bench/cpu_paged_attention.py --batches 1 8 32 --rounds 3 --output-len 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from common import format_table, machine_info, random_prompts, special_token_ids, write_json
from tqdm import tqdm

from radixserve import Engine, hookimpl
from radixserve.core.plugins import PluginHost
from radixserve.plugins.models.gguf_loader import convert_gguf_to_hf_dir, default_model_gguf_path

BACKENDS = ("cpu_paged", "torch_native")


class DecodeClock:
    """Wall time and tokens of decode-only steps, from the engine's step hook."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0
        self._last = time.perf_counter()

    @hookimpl
    def step_finished(self, stats: dict[str, Any]) -> None:
        now = time.perf_counter()
        if not stats["num_prefill_tokens"]:
            self.seconds += now - self._last
            self.steps += 1
        self._last = now


def run_round(engine: Engine, clock: DecodeClock, prompts: list[list[int]], output_len: int
              ) -> tuple[float, float, list[list[int]]]:  # fmt: skip
    """(decode ms a step, end-to-end tok/s, outputs)."""
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    clock.seconds, clock.steps = 0.0, 0
    clock._last = start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - start
    return (
        clock.seconds / max(clock.steps, 1) * 1e3,
        len(prompts) * output_len / wall,
        [o["output_ids"] for o in outs],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json-out", help="write the results here")
    args = p.parse_args()
    model = convert_gguf_to_hf_dir(default_model_gguf_path())
    avoid = special_token_ids(model)
    engines, clocks = {}, {}
    for name in BACKENDS:
        clocks[name] = DecodeClock()
        host = PluginHost(extra_plugins=[(f"clock-{name}", clocks[name])])
        engines[name] = Engine(str(model), plugins=[f"attention={name}"], host=host)
        engines[name].generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 4})
    rows, results = [], []
    try:
        for batch in args.batches:
            step_ms: dict[str, list[float]] = {n: [] for n in BACKENDS}
            tok_s: dict[str, list[float]] = {n: [] for n in BACKENDS}
            same = total = 0
            for r in tqdm(range(args.rounds), desc=f"batch {batch}", leave=False):
                seed = 1000 * batch + r
                prompts = random_prompts(batch, args.input_len, 49152, avoid, seed=seed)
                outs = {}
                for name in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                    ms, tps, outs[name] = run_round(engines[name], clocks[name], prompts,
                                                    args.output_len)  # fmt: skip
                    step_ms[name].append(ms)
                    tok_s[name].append(tps)
                same += sum(a == b for a, b in zip(*outs.values(), strict=True))
                total += batch
            med = {n: (statistics.median(step_ms[n]), statistics.median(tok_s[n]))
                   for n in BACKENDS}  # fmt: skip
            (ms_p, tps_p), (ms_t, tps_t) = med["cpu_paged"], med["torch_native"]
            rows.append([batch, f"{ms_p:.1f}", f"{ms_t:.1f}", f"{ms_t / ms_p:.2f}x", f"{tps_p:.2f}",
                         f"{tps_t:.2f}", f"{tps_p / tps_t:.2f}x", f"{same}/{total}"])  # fmt: skip
            results.append({"batch": batch, "step_ms": step_ms, "tok_s": tok_s,
                            "same_outputs": same, "requests": total})  # fmt: skip
    finally:
        for engine in engines.values():
            engine.shutdown()
    headers = ["batch", "cpu_paged step ms", "torch_native step ms", "step ratio",
               "cpu_paged tok/s", "torch_native tok/s", "tok/s ratio", "same outputs"]  # fmt: skip
    print(format_table(headers, rows))
    if args.json_out:
        payload = {"machine": machine_info(), "args": vars(args), "results": results}
        write_json(args.json_out, payload)


if __name__ == "__main__":
    main()
