"""Where a speculative step's time goes at batch 1, on CUDA with simulated acceptance: a
cProfile of the engine loop (host time), then a torch.profiler trace of a shorter run, which
gives the device's busy time per step against the step's wall time (the difference is time the
GPU waits for the host) and the kernels it spends it on. A diagnostic, not a benchmark.

    python bench/spec_profile.py TARGET_DIR DRAFT_DIR                 # STANDALONE, accept 3.5
    python bench/spec_profile.py --shape smollm2 --algorithm EAGLE3 --accept 3.0
        # random weights of a bench/gpu_model.py shape and a random EAGLE-3 head
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

from radixserve.core.config import EngineConfig  # noqa: E402
from radixserve.core.engine_core import EngineCore  # noqa: E402
from radixserve.core.plugins import default_host  # noqa: E402
from radixserve.core.request import Req, SamplingParams  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("target", nargs="?", help="target model directory (default: --shape)")
p.add_argument("draft", nargs="?", help="STANDALONE's draft model directory")
p.add_argument("--shape", default="llama3-8b", help="random weights of this shape")
p.add_argument("--algorithm", default="STANDALONE")
p.add_argument("--accept", type=float, default=3.5, help="simulated accept length")
p.add_argument("--workdir", default="/tmp/models")
p.add_argument("--sort", default="cumulative", help="pstats order: cumulative or tottime")
args = p.parse_args()
if args.target:
    target = Path(args.target)
else:
    from gpu_model import write_random_llama

    target = Path(args.workdir) / args.shape
    if not (target / "config.json").exists():
        write_random_llama(target, args.shape, "cuda" if torch.cuda.is_available() else "cpu")
draft = args.draft
if args.algorithm == "EAGLE3" and draft is None:
    from speculative import write_random_eagle3

    draft = str(Path(args.workdir) / f"{target.name}-eagle3-random")
    if not (Path(draft) / "config.json").exists():
        write_random_eagle3(target, Path(draft), "cuda" if torch.cuda.is_available() else "cpu")
vocab = int(__import__("json").loads((target / "config.json").read_text())["vocab_size"])
spec = dict(
    speculative_algorithm=args.algorithm,
    speculative_simulate_accept_len=args.accept,
    **({"speculative_draft_model_path": draft} if draft else {}),
)
for name, kw in (("off", {}), ("spec", spec)):
    core = EngineCore(target, EngineConfig(model_path=str(target), **kw), default_host())
    rng = random.Random(0)

    def run(n: int, core: EngineCore = core, rng: random.Random = rng) -> int:
        ids = [rng.randrange(3, vocab) for _ in range(512)]
        core.add_request(
            Req(
                str(rng.random()),
                ids,
                SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True),
            )
        )
        steps = 0
        while core.has_work():
            core.step()
            steps += 1
        return steps

    run(64)
    prof = cProfile.Profile()
    prof.enable()
    start = time.perf_counter()
    steps = run(256)
    seconds = time.perf_counter() - start
    prof.disable()
    print(f"{name}: {steps} steps, {seconds / steps * 1e3:.2f} ms/step, {256 / seconds:.1f} tok/s")
    pstats.Stats(prof).sort_stats(args.sort).print_stats(40)
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
            torch.cuda.synchronize()
            start = time.perf_counter()
            steps = run(128)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        events = trace.key_averages()
        # Kernels only (a CPU op's device time is that of the kernels it launched).
        device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
        print(
            f"{name} traced: {steps} steps, wall {seconds / steps * 1e3:.2f} ms/step, "
            f"device busy {device_us / steps / 1e3:.2f} ms/step (incl. the 512-token prefill)"
        )
        print(events.table(sort_by="self_device_time_total", row_limit=20))
    core.shutdown()
