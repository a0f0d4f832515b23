#!/usr/bin/env python
"""Per-step cost of the output path between the engine and HTTP processes (issue 24), at many
concurrent streams, on the CPU and without a model.

Every step each of ``--streams`` requests gains one random token of the default model's
vocabulary (its tokenizer, so the text is real). Timed per step, as ``radixserve serve`` runs
them:

- core: appending the token (incremental detokenization, stop checks): what the offline
  Engine does too, shown for scale;
- engine: gathering the step's outputs and encoding the message (StepOutputBuilder,
  ipc.encode): work only the server's engine process does, in the step loop;
- server: decoding the message and updating each request (TokenizerManager._on_step);
- render: each stream's native /generate event (NativeServing.result, sse), without the
  HTTP stack.

    python bench/output_path.py --streams 256 --steps 256
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import types
from typing import Any

from common import machine_info, write_json

from radixserve.core.request import Req, SamplingParams
from radixserve.core.stop import StopChecker
from radixserve.core.tokenizer import Tokenizer
from radixserve.entrypoints import ipc
from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.serving_native import LogprobOptions, NativeServing
from radixserve.entrypoints.step_output import StepOutputBuilder
from radixserve.entrypoints.streaming import sse
from radixserve.entrypoints.tokenizer_manager import TokenizerManager
from radixserve.plugins.models.gguf_loader import convert_gguf_to_hf_dir, default_model_gguf_path

PARTS = ("core_append", "engine_build_encode", "server_decode_apply", "render_events")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=256, help="tokens per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


async def measure(args: argparse.Namespace, tokenizer: Tokenizer) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocab = tokenizer.vocab_size
    checker = StopChecker(tokenizer, (), 1 << 30)
    params = SamplingParams(max_new_tokens=args.steps, ignore_eos=True)
    reqs = [
        Req(f"r{i:05d}", [rng.randrange(100, vocab) for _ in range(args.prompt_len)], params)
        for i in range(args.streams)
    ]
    builder = StepOutputBuilder()
    ready = types.SimpleNamespace(vocab_size=vocab, speculative=None)
    client = types.SimpleNamespace(on_step=None, on_death=None, dead=None)
    tm = TokenizerManager(client, ready, tokenizer)  # type: ignore[arg-type]
    event = asyncio.Event()
    followed = [ServerReq(req.rid, req.input_ids, params, event) for req in reqs]
    tm.reqs.update((sr.rid, sr) for sr in followed)
    native, options = NativeServing(tm), LogprobOptions()
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    message_bytes = 0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        for req in reqs:
            checker.append(req, rng.randrange(100, vocab))
        t1 = time.perf_counter()
        for req in reqs:
            builder.add(req)
        out = builder.take()
        assert out is not None
        data = ipc.encode(out)
        t2 = time.perf_counter()
        received = ipc.decode_outbound(data)
        assert isinstance(received, ipc.StepOutput)
        tm._on_step(received)
        t3 = time.perf_counter()
        for sr in followed:
            sse(native.result(sr, options))
        t4 = time.perf_counter()
        for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[part].append(seconds)
        message_bytes = max(message_bytes, len(data))
    # every request arrived whole and finished (the check that the path is not just fast)
    for req, sr in zip(reqs, followed, strict=True):
        assert sr.finished and sr.output_ids == req.output_ids
        assert sr.text == req.detok.text  # type: ignore[union-attr]
    # the median step: a shared machine's other work lands in a few steps, not in all
    per_step_us = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {
        "per_step_us": per_step_us,
        "per_request_us": {k: v / args.streams for k, v in per_step_us.items()},
        "largest_message_bytes": message_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = Tokenizer(convert_gguf_to_hf_dir(default_model_gguf_path()))
    res = asyncio.run(measure(args, tokenizer))
    print(f"{args.streams} streams x {args.steps} steps, median step (per request) in us:")
    for part in PARTS:
        print(f"  {part:<22}{res['per_step_us'][part]:>9.0f}  ({res['per_request_us'][part]:.2f})")
    print(f"  largest message: {res['largest_message_bytes']} bytes")
    if args.json_out:
        write_json(args.json_out, {"args": vars(args), "machine": machine_info(), **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
