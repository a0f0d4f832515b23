"""Speculative decoding against speculation off, in the same run.

``model`` (alias ``cpu``; the default model, greedy, real acceptance): each workload group of
bench/spec_workloads.py runs with speculation off, then with each drafter asked for, on engines
given no tuning flags, one request at a time or ``--batches`` at once, on the CPU or
``--device cuda``. Prints output tokens per second, the ratio and the accept length per group
and batch (tokens a request gains per verify step).

``gpu`` (a random-weight model of a real shape on CUDA, --simulate): throughput at several batch
sizes with speculation off, then with a drafter whose acceptance is simulated
(--speculative-simulate-accept-len): the real draft and verify work runs, the number of
accepted drafts is drawn around the chosen mean, so the cost of the verify path is visible.

    python bench/speculative.py cpu [--groups code_edit json_repeat ...] [--algorithm NGRAM EAGLE3]
    python bench/speculative.py model --device cuda --model-path X.gguf --algorithm EAGLE3 EAGLE \\
        DFLASH --batches 1 8 32
    python bench/speculative.py cpu --algorithm EAGLE3 --groups json_repeat --rounds 3
    python bench/speculative.py cpu --algorithm EAGLE3 --adaptive --batches 1 8   (A/B)
    python bench/speculative.py gpu --shape llama3-8b --accept 1.5 2.5 3.5 --batches 1 8 64
    python bench/speculative.py gpu --algorithm EAGLE3 --accept 3.0 --batches 1 8 32 --num-draft 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, machine_info, write_json  # noqa: E402
from tqdm import tqdm  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.core.spec_strategy import speculator_of


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    model = sub.add_parser(
        "model", aliases=["cpu"], help="the default model, real acceptance, speculation vs off"
    )
    model.add_argument("--groups", nargs="*", default=None, help="workload groups (default: all)")
    model.add_argument(
        "--algorithm", nargs="+", default=["NGRAM"],
        help="one engine each; NAME or NAME:topk=W,nodes=N,steps=D for draft trees (EAGLE, "
        "EAGLE3: --speculative-eagle-topk W, N nodes, depth D); NAME:loop=0 runs every "
        "speculative step from the host (--disable-speculative-loop)",
    )  # fmt: skip
    model.add_argument("--batches", type=int, nargs="+", default=[1])
    model.add_argument("--device", default="cpu", help="the hardware plugin: cpu or cuda")
    model.add_argument("--model-path", default=None, help="default: the default model")
    model.add_argument(
        "--disable-pause",
        action="store_true",
        help="speculating engines keep drafting for every request (--speculative-disable-pause)",
    )
    model.add_argument(
        "--disable-batch-size",
        type=int,
        default=None,
        help="speculate up to this batch size (--speculative-disable-batch-size; default: the "
        "platform's cut-off, which is what users get)",
    )
    model.add_argument(
        "--adaptive",
        action="store_true",
        help="A/B: each algorithm also runs with --speculative-adaptive (column NAME+adaptive)",
    )
    model.add_argument(
        "--num-steps",
        type=int,
        default=None,
        help="draft tokens a step (--speculative-num-steps; a tuning flag, default 4)",
    )
    model.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat speculation off and each algorithm this many times, alternating; ratios "
        "are taken within a round and the median is reported (a VM's speed drifts between "
        "engines)",
    )
    model.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="first run every group once with speculation off, untimed (default: on for "
        "cuda, where the first engine of a device call ran up to 1.5x slower than later "
        "ones, 2026-12-03)",
    )
    model.add_argument(
        "--engine",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting for every engine, speculation off too (an A-B of a core "
        "setting, e.g. cuda_graph_max_prefill_tokens=0; integers as such)",
    )
    model.add_argument("--json-out", default=None)
    gpu = sub.add_parser("gpu", help="random weights on CUDA, simulated acceptance")
    gpu.add_argument("--shape", default="llama3-8b")
    gpu.add_argument("--draft-shape", default="draft-1layer", help="the standalone draft's shape")
    gpu.add_argument(
        "--algorithm",
        default="STANDALONE",
        choices=["STANDALONE", "EAGLE3"],
        help="EAGLE3: a random-weight EAGLE-3 head for the target (32k draft vocabulary)",
    )
    gpu.add_argument("--accept", type=float, nargs="+", default=[1.5, 2.5, 3.5])
    gpu.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    gpu.add_argument("--num-draft", type=int, default=4)
    gpu.add_argument("--input-len", type=int, default=512)
    gpu.add_argument("--output-len", type=int, default=256)
    gpu.add_argument("--workdir", default="/tmp/models")
    gpu.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    gpu.add_argument("--json-out", default=None)
    return p.parse_args()


# -- The default model, real acceptance ------------------------------------------------------


def time_mode(
    flags: dict[str, Any], base: dict[str, Any], names: list[str], batches: list[int]
) -> dict[str, dict[int, tuple[int, float, int, int]]]:
    """One engine's (output tokens, seconds, verify steps, accepted drafts) per workload group
    and batch size."""
    from spec_workloads import workload_group

    groups = {name: workload_group(name) for name in names}
    timings: dict[str, dict[int, tuple[int, float, int, int]]] = {n: {} for n in names}
    mode = flags.get("speculative_algorithm", "off")
    with Engine(**base, **flags) as engine:
        warm = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi there!"}])
        for bs in batches:  # compile every kernel shape before anything is timed
            engine.generate(input_ids=[warm] * bs, sampling_params={"max_new_tokens": 16})
        for name in names:
            prompts = [engine.tokenizer.encode_chat(w.messages) for w in groups[name]]
            limits = [w.max_new_tokens for w in groups[name]]
            for bs in batches:
                tokens, seconds, verify, accepted = 0, 0.0, 0, 0
                count = max(len(prompts), bs)
                for at in tqdm(range(0, count, bs), desc=f"{mode} {name} bs{bs}", leave=False):
                    picks = [(at + j) % len(prompts) for j in range(bs)]
                    params = [{"temperature": 0, "max_new_tokens": limits[j]} for j in picks]
                    start = time.perf_counter()
                    outs = engine.generate(
                        input_ids=[prompts[j] for j in picks], sampling_params=params
                    )
                    seconds += time.perf_counter() - start
                    for out in outs:
                        tokens += len(out["output_ids"])
                        verify += out["meta_info"].get("spec_verify_ct", 0)
                        accepted += out["meta_info"].get("spec_accepted_tokens", 0)
                timings[name][bs] = (tokens, seconds, verify, accepted)
    return timings


def run_model(args: argparse.Namespace) -> dict[str, Any]:
    """Each workload group with speculation off, then with each algorithm, on engines given
    no tuning flags (only the model path and the device's hardware plugin; the cut-off only
    where --disable-batch-size asks). At batch B the group's prompts go B at a time (cycled to
    fill the batch). Each engine runs in a process of its own, so no engine's device memory is
    left to the next one's sizing. With --rounds R the whole sequence runs R times; a ratio is
    speculation on against off of the same round, and the median over rounds is reported."""
    import multiprocessing
    import statistics
    from concurrent.futures import ProcessPoolExecutor

    from spec_workloads import all_workloads

    names = args.groups or list(all_workloads())
    results: dict[str, Any] = {"machine": machine_info(), "device": args.device, "groups": {}}
    base: dict[str, Any] = {"plugins": [f"hardware={args.device}"]}
    for item in args.engine:
        key, _, value = item.partition("=")
        base[key] = int(value) if value.lstrip("-").isdigit() else value
    results["base_flags"] = {k: v for k, v in base.items() if k != "plugins"}
    if args.model_path:
        base["model_path"] = args.model_path
    extra: dict[str, Any] = {"speculative_disable_pause": True} if args.disable_pause else {}
    if args.disable_batch_size is not None:
        extra["speculative_disable_batch_size"] = args.disable_batch_size
    if args.num_steps is not None:
        extra["speculative_num_steps"] = args.num_steps
    results["engine_flags"] = extra
    modes = {"off": {}} | {a: {**algorithm_flags(a), **extra} for a in args.algorithm}
    if args.adaptive:  # the A/B: the same engines with adaptive draft lengths
        modes |= {
            f"{a}+adaptive": {**modes[a], "speculative_adaptive": True} for a in args.algorithm
        }
    columns = [m for m in modes if m != "off"]
    # rounds[r][mode][group][batch] = (output tokens, seconds, verify steps, accepted drafts)
    rounds: list[dict[str, dict[str, dict[int, tuple[int, float, int, int]]]]] = []
    spawn = multiprocessing.get_context("spawn")
    if args.warmup if args.warmup is not None else args.device != "cpu":
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            pool.submit(time_mode, {}, base, names, args.batches).result()
        print("warm-up (speculation off, untimed): done", flush=True)
    for r in range(args.rounds):
        rounds.append({})
        for mode, flags in modes.items():
            with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                rounds[r][mode] = pool.submit(time_mode, flags, base, names, args.batches).result()
            print(f"round {r}: {mode} done", flush=True)
    rows = []
    for name in names:
        for bs in args.batches:
            offs = [_rate(t["off"][name][bs]) for t in rounds]
            off = statistics.median(offs)
            entry: dict[str, Any] = {
                "off_tok_s": round(off, 2),
                "off_tokens": rounds[0]["off"][name][bs][0],
                "off_tok_s_rounds": [round(x, 2) for x in offs],
            }
            row = [name, bs, f"{off:.1f}"]
            for algorithm in columns:
                ons = [_rate(t[algorithm][name][bs]) for t in rounds]
                ratios = [on / o for on, o in zip(ons, offs, strict=True)]
                verify = sum(t[algorithm][name][bs][2] for t in rounds)
                accepted = sum(t[algorithm][name][bs][3] for t in rounds)
                accept_len = (verify + accepted) / verify if verify else 1.0
                ratio = statistics.median(ratios)
                entry[algorithm] = {
                    "tok_s": round(statistics.median(ons), 2),  # the median round's
                    "ratio": round(ratio, 3),
                    "ratio_rounds": [round(x, 3) for x in ratios],
                    "accept_length": round(accept_len, 3),
                    "verify_steps": verify,
                    "output_tokens": rounds[0][algorithm][name][bs][0],
                }
                spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
                on = statistics.median(ons)
                row += [f"{on:.1f}", f"{ratio:.2f}x{spread}", f"{accept_len:.2f}"]
            results["groups"][f"{name}-bs{bs}"] = entry
            rows.append(row)
    head = ["group", "batch", "off tok/s"]
    for algorithm in columns:
        ratio_head = "ratio (range)" if args.rounds > 1 else "ratio"
        head += [f"{algorithm} tok/s", ratio_head, "accept len"]
    print(format_table(head, rows))
    return results


def algorithm_flags(spec: str) -> dict[str, Any]:
    """Engine flags of an --algorithm entry: NAME, or NAME:topk=W,nodes=N,steps=D."""
    name, _, shape = spec.partition(":")
    flags: dict[str, Any] = {"speculative_algorithm": name}
    keys = {"topk": "speculative_eagle_topk", "steps": "speculative_num_steps"}
    for item in filter(None, shape.split(",")):
        key, _, value = item.partition("=")
        if key == "nodes":
            flags["speculative_num_draft_tokens"] = int(value) + 1
        elif key == "loop":  # loop=0: every step from the host (--disable-speculative-loop)
            flags["disable_speculative_loop"] = value == "0"
        elif key in keys:
            flags[keys[key]] = int(value)
        else:
            raise SystemExit(f"--algorithm {spec}: unknown key {key!r} (topk, nodes, steps, loop)")
    return flags


def _rate(timing: tuple[int, float, int, int]) -> float:
    return timing[0] / timing[1]


# -- GPU: random weights, simulated acceptance ------------------------------------------------


DRAFT_SHAPES = {
    # An EAGLE-sized drafter: one decoder layer at a reduced width, the target's vocabulary.
    "draft-1layer": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=8,
    ),
    "draft-tiny": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2,
    ),
}  # fmt: skip


def write_random_eagle3(target: Path, out: Path, device: str, draft_vocab: int = 32000) -> None:
    """A random-weight EAGLE-3 head shaped for ``target`` (its cost is what is measured; with
    simulated acceptance its drafts' values do not matter), saved in the target's dtype."""
    import torch

    from radixserve.core.config import ModelConfig
    from radixserve.plugins.speculative.eagle3_head import new_head
    from radixserve.plugins.speculative.head_layer import save_head

    mc = ModelConfig.from_dir(target)
    vocab = min(draft_vocab, mc.vocab_size)
    embed = torch.randn(mc.vocab_size, mc.hidden_size) * 0.02
    n = mc.num_layers
    aux = None if n >= 8 else [0, n // 2, n - 1]  # the smoke test's tiny target
    head = new_head(mc, embed, torch.arange(vocab), aux_layers=aux, device="cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    save_head(head, out, dtype, {"command": "bench/speculative.py gpu --algorithm EAGLE3"})


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from gpu_model import SHAPES, write_random_llama

    import radixserve.core.speculative as speculative

    work = Path(args.workdir)
    target = work / args.shape
    if not (target / "config.json").exists():
        write_random_llama(target, args.shape, args.device)
    draft = work / f"{args.shape}-{args.draft_shape}"
    if not (draft / "config.json").exists():
        SHAPES[f"{args.shape}-{args.draft_shape}"] = {
            **SHAPES[args.shape],
            **DRAFT_SHAPES[args.draft_shape],
        }
        write_random_llama(draft, f"{args.shape}-{args.draft_shape}", args.device, seed=1)
    if args.algorithm == "EAGLE3":
        draft = work / f"{args.shape}-eagle3-random"
        if not (draft / "config.json").exists():
            write_random_eagle3(target, draft, args.device)
    vocab = SHAPES[args.shape]["vocab_size"]
    # Full drafts at every batch size measured (the default shrinks them past 8 requests).
    speculative.FULL_DRAFT_BATCH = max(args.batches)
    results: dict[str, Any] = {"machine": machine_info(), "shape": args.shape, "runs": {}}
    base: dict[str, Any] = dict(
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_running_requests=max(args.batches),
        plugins=[f"hardware={args.device}"],
    )

    def prompts(n: int) -> list[list[int]]:
        rng = random.Random(n)
        return [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(n)]

    def counters(engine: Engine) -> dict[str, int]:
        """Engine steps, verify steps replayed from a graph, draft chains replayed."""
        algorithm = getattr(speculator_of(engine.core), "algorithm", None)
        chain = getattr(algorithm, "chain", None)
        stats = engine.core.spec_stats() or {}
        return {
            "verified": int(stats.get("verified_requests", 0)),
            "accepted": int(stats.get("accepted_tokens", 0)),
            "steps": engine.core.scheduler.stats.steps,
            "verify_replays": getattr(engine.core.runner.step, "verify_replays", 0),
            "chain_replays": chain.replays if chain is not None else 0,
        }

    def throughput(engine: Engine, bs: int) -> float:
        params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
        batch = prompts(bs)
        # Warm-up at this batch size: Triton compiles kernels for the shapes it first meets
        # (verify, draft catch-up), which must not land in the timed run.
        engine.generate(
            input_ids=prompts(bs + 1000)[:bs], sampling_params={**params, "max_new_tokens": 64}
        )
        before = counters(engine)
        start = time.perf_counter()
        engine.generate(input_ids=batch, sampling_params=params)
        seconds = time.perf_counter() - start
        timed = {k: v - before[k] for k, v in counters(engine).items()}
        timed["ms_per_step"] = round(seconds / max(1, timed["steps"]) * 1e3, 3)
        if timed["verified"]:  # this run's own accept length (the engine's stats accumulate)
            timed["accept_length"] = round(1 + timed["accepted"] / timed["verified"], 3)
        last_counts[bs] = timed
        return bs * args.output_len / seconds

    off: dict[int, float] = {}
    last_counts: dict[int, dict[str, Any]] = {}  # the timed run's steps and graph replays
    with Engine(str(target), **base) as engine:
        for bs in args.batches:
            off[bs] = throughput(engine, bs)
            results["runs"][f"off-bs{bs}"] = {"tok_s": round(off[bs], 1), **last_counts[bs]}
            print(f"off bs={bs}: {off[bs]:.1f} tok/s {last_counts[bs]}", flush=True)
    rows = []
    for accept in args.accept:
        spec = dict(
            speculative_algorithm=args.algorithm,
            speculative_draft_model_path=str(draft),
            speculative_num_steps=args.num_draft,
            speculative_simulate_accept_len=accept,
            speculative_disable_batch_size=max(args.batches),
        )
        with Engine(str(target), **base, **spec) as engine:
            for bs in args.batches:
                on = throughput(engine, bs)
                stats = engine.core.spec_stats() or {}
                key = f"accept{accept}-bs{bs}"
                results["runs"][key] = {
                    "off_tok_s": round(off[bs], 1),
                    "spec_tok_s": round(on, 1),
                    "ratio": round(on / off[bs], 3),
                    "measured_accept_length": stats.get("avg_accept_length"),
                    **last_counts[bs],
                }
                rows.append([accept, bs, f"{off[bs]:.0f}", f"{on:.0f}", f"{on / off[bs]:.2f}x"])
                print(rows[-1], last_counts[bs], flush=True)
                if args.json_out:  # as it goes: a run cut short keeps what it measured
                    write_json(args.json_out, results)
    print(format_table(["sim. accept len", "batch", "off tok/s", "spec tok/s", "ratio"], rows))
    return results


def main() -> None:
    args = parse_args()
    results = run_gpu(args) if args.mode == "gpu" else run_model(args)
    if args.json_out:
        write_json(args.json_out, results)


if __name__ == "__main__":
    main()
