"""Step by step, what a batch of speculating requests costs: each engine step's wall time,
grouped by the shape of its forward (decode-only, verify with one draft length for all, verify
with ragged drafts, mixed), with speculation off and on, over two rounds of the same prompts
(the second shows what is left once every shape was met). A diagnostic, not a benchmark.

    python bench/spec_steps.py --shape smollm2 --algorithm NGRAM --batch 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

import torch  # noqa: E402

from radixserve.core.config import EngineConfig  # noqa: E402
from radixserve.core.engine_core import EngineCore  # noqa: E402
from radixserve.core.plugins import default_host  # noqa: E402
from radixserve.core.request import Req, SamplingParams  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--shape", default="smollm2", help="random weights of a bench/gpu_model.py shape")
p.add_argument("--algorithm", default="NGRAM")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--new-tokens", type=int, default=192)
p.add_argument("--workdir", default="/tmp/models")
args = p.parse_args()

from gpu_model import write_random_llama  # noqa: E402

from radixserve.core.spec_strategy import speculator_of  # noqa: E402

target = Path(args.workdir) / args.shape
if not (target / "config.json").exists():
    write_random_llama(target, args.shape, "cuda" if torch.cuda.is_available() else "cpu")
vocab = int(__import__("json").loads((target / "config.json").read_text())["vocab_size"])


def kind_of(batch) -> str:  # type: ignore[no-untyped-def]
    bs = batch.batch_size
    if batch.num_decode == bs:
        return "decode"
    if max(batch.extend_lens) > 16:
        return "prefill" if not batch.num_decode else "mixed"
    if batch.num_decode:
        return "decodes + verifies"
    return "verify same q" if len(set(batch.extend_lens)) == 1 else "verify ragged"


for name, kw in (("off", {}), (args.algorithm, {"speculative_algorithm": args.algorithm})):
    core = EngineCore(target, EngineConfig(model_path=str(target), **kw), default_host())
    forward = core.runner.step
    kinds: list[str] = []

    def recording(batch, forward=forward, kinds=kinds):  # type: ignore[no-untyped-def]
        kinds.append(kind_of(batch))
        return forward(batch)

    core.runner.step = recording
    rng = random.Random(0)
    phrases = [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(args.batch)]
    for round_ in (1, 2):
        for i, phrase in enumerate(phrases):
            params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
            core.add_request(Req(f"{round_}-{i}", phrase * 12, params))
        times: dict[str, list[float]] = defaultdict(list)
        start = time.perf_counter()
        while core.has_work():
            kinds.clear()
            t = time.perf_counter()
            core.step()
            times["+".join(kinds) or "none"].append(time.perf_counter() - t)
        seconds = time.perf_counter() - start
        tokens = args.batch * args.new_tokens
        print(f"{name} round {round_}: {tokens / seconds:.0f} tok/s, {seconds:.2f} s")
        for kind, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
            print(f"   {kind:28s} {len(ts):5d} steps  mean {statistics.mean(ts) * 1e3:7.2f} ms"
                  f"  max {max(ts) * 1e3:8.2f} ms  total {sum(ts):6.2f} s")  # fmt: skip
    if speculator_of(core) is not None:
        print("  ", core.spec_stats())
    core.shutdown()
    del core, forward, recording
    __import__("gc").collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next engine sizes its KV pool from what is free
