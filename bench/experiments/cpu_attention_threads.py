"""CPU decode attention on one thread against the intra-op pool (issue 19): one engine per
weight format, the default model, greedy requests at batch 1 and 8, rounds alternating between
small decode attentions on one thread (``torch_native.SERIAL_DECODE_TOKENS``, the default) and
every attention on all of torch's threads (the constant set to 0), in the same process.

    python bench/cpu_attention_threads.py                 # int4wo + compile, and float32
    python bench/cpu_attention_threads.py --rounds 4 --output-len 128
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tqdm import tqdm

from radixserve import Engine
from radixserve.plugins.attention import torch_native
from radixserve.plugins.models.gguf_loader import convert_gguf_to_hf_dir, default_model_gguf_path

FORMATS: dict[str, dict[str, Any]] = {
    "int4wo+compile": {"quantization": "int4wo", "enable_torch_compile": True},
    "float32": {},
}


def tokens_per_s(engine: Engine, batch: int, output_len: int, round_: int) -> float:
    prompts = [f"Round {round_}, story {i}: write about the sea at night." for i in range(batch)]
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(prompt=prompts, sampling_params=params)
    return batch * output_len / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=96)
    args = p.parse_args()
    model = convert_gguf_to_hf_dir(default_model_gguf_path())
    serial = torch_native.SERIAL_DECODE_TOKENS
    print(
        f"{'format':16s} {'batch':>5s} {'one thread tok/s':>17s} {'pool tok/s':>11s} {'ratio':>6s}"
    )
    for name in args.formats:
        with Engine(str(model), plugins=["hardware=cpu"], **FORMATS[name]) as engine:
            tokens_per_s(engine, 1, 16, -1)  # warm-up
            for batch in args.batches:
                runs: dict[int, list[float]] = {serial: [], 0: []}
                for r in tqdm(range(args.rounds), desc=f"{name} b{batch}", leave=False):
                    for limit in (serial, 0) if r % 2 == 0 else (0, serial):
                        torch_native.SERIAL_DECODE_TOKENS = limit
                        runs[limit].append(tokens_per_s(engine, batch, args.output_len, r))
                torch_native.SERIAL_DECODE_TOKENS = serial
                one, pool = statistics.median(runs[serial]), statistics.median(runs[0])
                print(f"{name:16s} {batch:5d} {one:17.2f} {pool:11.2f} {one / pool:5.2f}x")


if __name__ == "__main__":
    main()
