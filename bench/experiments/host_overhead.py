"""Per-step host overhead of the engine loop on the CPU, where a tiny random Llama (32 layers,
hidden 64) makes every step's time Python and per-layer dispatch, like a GPU step in eager mode
(no CUDA graphs). A diagnostic for issue 49 (the core redesign's eager and synchronous paths on
the H200), not a benchmark.

One tree per process: ``radixserve`` is whatever PYTHONPATH finds (a link folder whose
``radixserve`` points at a tree). ``--ab LABEL=FOLDER ...`` alternates subprocesses over such
folders, ``--rounds`` times each, and prints the median and minimum of each case:

    python bench/experiments/host_overhead.py --ab old=/work/old/.pp new=$PWD/.pp --rounds 3
    python bench/experiments/host_overhead.py --cases b1 spec --profile /tmp/new.prof

Cases: ``b1`` batch 1 greedy, ``b8`` batch 8, ``b8-overlap`` batch 8 with overlap scheduling,
``b1-overlap``, ``spec`` EAGLE-3 at batch 1 in the device-side loop (core/spec_loop.py, as on
a GPU; a random head, the same tokens in every tree), ``spec-host`` EAGLE-3 without the loop,
``ngram`` n-gram speculation at batch 1. Each: ``--tokens`` new tokens (ignore_eos) after a
warm-up, ``--repeats`` generate calls; the figure is the median engine step (``core.step``)
in microseconds, and tokens per second over the timed calls.

``--count-syncs`` counts instead, per decode step (model included), the calls that would make
a CUDA step's host wait (item, tolist, cpu, bool, nonzero, unique, masked indexing, ...), the
``.to`` / ``.copy_`` copies (target, non_blocking, pinned source) and the factories, by the
first stack frame inside the tree, and every torch function call; with ``--ab`` it prints a
table of the trees side by side (bench/HISTORY.md, issue 49).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CASES = ("b1", "b8", "b1-overlap", "b8-overlap", "spec", "spec-host", "ngram")


def build_models(workdir: Path, layers: int) -> tuple[Path, Path]:
    """The tiny target (random weights, ``layers`` layers) and a random EAGLE-3 head for it."""
    target, head = workdir / f"llama-{layers}l", workdir / f"eagle3-{layers}l"
    if (head / "config.json").exists():
        return target, head
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from random_heads import write_random_eagle3_head  # type: ignore[import-not-found]
    from tiny_models import make_tiny_llama_dir  # type: ignore[import-not-found]

    make_tiny_llama_dir(target, num_hidden_layers=layers, max_position_embeddings=2048)
    write_random_eagle3_head(target, head, [1, layers // 2, layers - 2])
    return target, head


def case_flags(case: str, head: Path) -> tuple[int, dict[str, Any]]:
    """(batch size, Engine flags) of ``case``."""
    batch = 8 if case.startswith("b8") else 1
    flags: dict[str, Any] = {}
    if case.endswith("overlap"):
        flags["enable_overlap_schedule"] = True
    else:
        flags["disable_overlap_schedule"] = True
    if case.startswith("spec"):
        flags.update(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(head),
            speculative_disable_pause=True,
            # the device-side loop, as on a GPU (the CPU runs it only when asked)
            enable_speculative_loop=case == "spec",
        )
    if case == "ngram":
        flags.update(speculative_algorithm="NGRAM", speculative_disable_pause=True)
    return batch, flags


#: the plugins both trees run here, registered directly (the installed entry points name the
#: newest tree's modules, some of which an older tree lacks)
PLUGIN_MODULES = (
    "models.llama", "grammar.none", "speculative.none", "speculative.eagle3",
    "speculative.ngram", "kv_transfer.none", "hicache_storage.none",
)  # fmt: skip
#: per --device: the hardware plugin and the attention backend
DEVICE_PLUGINS = {
    "cpu": ("hardware.cpu", "attention.torch_native"),
    "cuda": ("hardware.cuda", "attention.triton"),
}


def plugin_host(device: str) -> Any:
    import importlib

    from radixserve.core.plugins import PluginHost

    plugins = []
    for name in DEVICE_PLUGINS[device] + PLUGIN_MODULES:
        try:
            module = importlib.import_module(f"radixserve.plugins.{name}")
        except ModuleNotFoundError:
            continue  # a kind this tree does not have
        plugins.append((name.replace(".", "_"), module))
    return PluginHost(load_entry_points=False, extra_plugins=plugins)


def engine(model: Path, flags: dict[str, Any], device: str) -> Any:
    from radixserve import Engine

    hardware, attention = (m.rsplit(".", 1)[1] for m in DEVICE_PLUGINS[device])
    if device == "cuda":
        flags = {**flags, "disable_cuda_graph": True, "dtype": "bfloat16"}
    else:
        flags = {**flags, "dtype": "float32"}
    return Engine(
        str(model), host=plugin_host(device), cpu_threads=1, max_total_tokens=16384,
        plugins=[f"hardware={hardware}", f"attention={attention}", "grammar=none"], **flags,
    )  # fmt: skip


def measure(
    model: Path, head: Path, case: str, tokens: int, repeats: int, device: str = "cpu"
) -> dict[str, Any]:
    import torch

    import radixserve

    torch.set_num_threads(1)
    batch, flags = case_flags(case, head)
    prompts = [[(7 * b + 3 * i) % 300 + 5 for i in range(32)] for b in range(batch)]
    params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0}
    with engine(model, flags, device) as eng:
        core = eng.core
        step = core.step
        times: list[float] = []
        cpu: list[float] = []  # the engine thread's CPU time: less noisy on a shared machine

        def timed_step() -> Any:
            t, c = time.perf_counter(), time.thread_time()
            out = step()
            cpu.append(time.thread_time() - c)
            times.append(time.perf_counter() - t)
            return out

        core.step = timed_step  # type: ignore[method-assign]
        forward = core.runner.step
        model_cpu: list[float] = []  # the step executor's (the model's) CPU time

        def timed_forward(batch: Any) -> Any:
            c = time.thread_time()
            out = forward(batch)
            model_cpu.append(time.thread_time() - c)
            return out

        core.runner.step = timed_forward
        eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 16})
        times.clear()
        cpu.clear()
        model_cpu.clear()
        start, start_cpu = time.perf_counter(), time.process_time()
        outs = [eng.generate(input_ids=prompts, sampling_params=params) for _ in range(repeats)]
        wall, process_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        ids = [o["output_ids"] for o in outs[0]] if isinstance(outs[0], list) else outs[0]
        runner = core.runner
        loaded = sorted({type(runner.model).__module__, type(runner.attention).__module__})
        return {
            "case": case,
            "tree": str(Path(radixserve.__file__).resolve().parent),
            "modules": [sys.modules[m].__file__ for m in loaded],
            "step_us_median": round(statistics.median(times) * 1e6, 1),
            "step_cpu_us_median": round(statistics.median(cpu) * 1e6, 1),
            # outside the model: the engine's own host work per step (the executor's CPU time
            # subtracted; steps of the device-side speculative loop call no executor)
            "host_cpu_us_per_step": round((sum(cpu) - sum(model_cpu)) / len(cpu) * 1e6, 1),
            "steps": len(times),
            "tok_s": round(batch * tokens * repeats / wall, 1),
            # every thread's CPU per generated token (the caller's thread included)
            "cpu_us_per_token": round(process_cpu / (batch * tokens * repeats) * 1e6, 1),
            "output_hash": zlib.crc32(json.dumps(ids, default=str).encode()),
        }


#: calls that wait for the device on CUDA (a value read back, or a shape only the data knows)
SYNC_METHODS = {
    "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
    "nonzero", "unique", "unique_consecutive", "masked_select", "equal", "allclose",
}  # fmt: skip
#: factories: an allocation each (on CUDA from the caching allocator), a copy from the host
#: where they take Python data and a device
FACTORIES = {
    "tensor", "as_tensor", "from_numpy", "empty", "zeros", "ones", "full", "arange",
    "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided", "stack", "cat",
}  # fmt: skip


def _has_bool_index(index: Any) -> bool:
    import torch

    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def sync_counter(tree: Path) -> Any:
    """A TorchFunctionMode counting, by the first stack frame inside ``tree``, the calls that
    would make a CUDA step's host wait or copy from the host (see --count-syncs)."""
    import collections
    import traceback

    import torch
    from torch.overrides import TorchFunctionMode

    roots = (str(tree) + os.sep, str(tree.resolve()) + os.sep)  # as imported, and resolved

    def site() -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            for root in roots:
                if frame.filename.startswith(root) and "/bench/" not in frame.filename:
                    return f"{frame.filename[len(root) :]}:{frame.lineno} {frame.name}"
        return "?"

    class Counter(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            name = getattr(func, "__name__", str(func))
            kind = None
            if name in SYNC_METHODS:
                kind = f"sync {name}"
            elif name in ("__getitem__", "__setitem__") and len(args) > 1:
                if _has_bool_index(args[1]):
                    kind = f"sync masked {name}"
            elif name == "repeat_interleave" and "output_size" not in kwargs:
                if (
                    len(args) > 1
                    and isinstance(args[1], torch.Tensor)
                    or isinstance(kwargs.get("repeats"), torch.Tensor)
                ):
                    kind = "sync repeat_interleave(tensor) without output_size"
            elif name in ("to", "copy_", "cuda"):
                src = args[0] if args and isinstance(args[0], torch.Tensor) else None
                pinned = bool(src is not None and src.is_pinned())
                nb = kwargs.get("non_blocking", False) or (
                    name == "copy_" and len(args) > 2 and bool(args[2])
                )
                target = [a for a in args[1:] if isinstance(a, (str, torch.device))]
                target += [kwargs["device"]] if "device" in kwargs else []
                if name == "copy_" or target:
                    where = target[0] if target else "-"
                    kind = f"copy {name} dev={where} nb={bool(nb)} pinned={pinned}"
            elif name in FACTORIES:
                dev = kwargs.get("device")
                kind = f"alloc {name}" + (f" device={dev}" if dev is not None else "")
                if name in ("tensor", "as_tensor") and dev is not None:
                    kind = f"h2d {name} device={dev}"
            self.counts[("(every torch function call)", "-")] += 1
            if kind is not None:
                with torch._C.DisableTorchFunction():
                    self.counts[(kind, site())] += 1
            return func(*args, **kwargs)

    return Counter()


def count_syncs(model: Path, head: Path, case: str, tokens: int, device: str) -> dict[str, Any]:
    """Per engine step of ``case``: the sync-like calls, copies and allocations, by site."""
    import torch

    import radixserve

    torch.set_num_threads(1)
    tree = Path(radixserve.__file__).parent
    batch, flags = case_flags(case, head)
    prompts = [[(7 * b + 3 * i) % 300 + 5 for i in range(32)] for b in range(batch)]
    params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0}
    with engine(model, flags, device) as eng:
        core = eng.core
        step, steps, counter = core.step, [0], sync_counter(tree)
        eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 16})

        def counted_step() -> Any:
            steps[0] += 1
            with counter:
                return step()

        core.step = counted_step  # type: ignore[method-assign]
        eng.generate(input_ids=prompts, sampling_params=params)
        core.step = step  # type: ignore[method-assign]
    n = steps[0]
    rows = sorted(counter.counts.items(), key=lambda kv: (kv[0][0], -kv[1]))
    return {
        "case": case, "tree": str(tree), "steps": n,
        "per_step": [[k, s, round(c / n, 3)] for (k, s), c in rows],
    }  # fmt: skip


def print_sync_table(by_tree: dict[str, dict[str, Any]]) -> None:
    """Per kind, each tree's calls a step; then each tree's sites (calls a step)."""
    import collections

    totals: dict[str, collections.Counter[str]] = {}
    for label, res in by_tree.items():
        tally: collections.Counter[str] = collections.Counter()
        for kind, _, c in res["per_step"]:
            tally[kind] += c
        totals[label] = tally
    labels = list(by_tree)
    kinds = sorted(set().union(*totals.values()))
    print("| kind | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(f"{totals[lb][kind]:.2f}" for lb in labels) + " |")
    for label, res in by_tree.items():
        print(f"\n{label} ({res['steps']} steps): calls a step by site")
        for kind, where, c in res["per_step"]:
            print(f"  {c:8.2f}  {kind:60} {where}")


def profile(
    model: Path, head: Path, case: str, tokens: int, out: str, host_only: bool = False,
    device: str = "cpu",
) -> None:  # fmt: skip
    import cProfile

    import torch

    torch.set_num_threads(1)
    batch, flags = case_flags(case, head)
    prompts = [[(7 * b + 3 * i) % 300 + 5 for i in range(32)] for b in range(batch)]
    params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0}
    with engine(model, flags, device) as eng:
        eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 16})
        # the engine thread's CPU time (a shared machine's waits do not count); the model's
        # forward left out with --host-only (what differs between trees is the loop's)
        core, prof = eng.core, cProfile.Profile(time.thread_time)
        step, forward = core.step, core.runner.step

        def profiled_step() -> Any:
            prof.enable()
            try:
                return step()
            finally:
                prof.disable()

        def unprofiled_forward(batch: Any) -> Any:
            prof.disable()
            try:
                return forward(batch)
            finally:
                prof.enable()

        core.step = profiled_step  # type: ignore[method-assign]
        if host_only:
            core.runner.step = unprofiled_forward
        eng.generate(input_ids=prompts, sampling_params=params)
        prof.dump_stats(out)


def ab(args: argparse.Namespace) -> None:
    """Alternate the trees' subprocesses; print each case's medians and minima."""
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    trees = [tuple(t.split("=", 1)) for t in args.ab]
    for r in range(args.rounds):
        for label, pp in trees:
            for case in args.cases:
                env = {**os.environ, "PYTHONPATH": pp}
                cmd = [sys.executable, __file__, "--workdir", str(args.workdir), "--cases", case,
                       "--tokens", str(args.tokens), "--repeats", str(args.repeats),
                       "--layers", str(args.layers), "--device", args.device]  # fmt: skip
                cmd += ["--count-syncs"] if args.count_syncs else []
                line = (
                    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                    .stdout.strip()
                    .splitlines()[-1]
                )
                res = json.loads(line)
                results.setdefault((case, label), []).append(res)
                if args.count_syncs:
                    continue
                print(f"round {r} {label:3} {json.dumps(res)}", flush=True)
    if args.count_syncs:
        for case in args.cases:
            print(f"\n## {case}: calls a step (decode steps, --tokens {args.tokens})\n")
            print_sync_table({label: results[(case, label)][0] for label, _ in trees})
        return
    print(
        "\ncase        tree  step wall us med/min   step CPU us med/min   host CPU us/step med/min"
        "   tok/s med/max   output hashes"
    )
    for case in args.cases:
        for label, _ in trees:
            rs = results[(case, label)]
            keys = ("step_us_median", "step_cpu_us_median", "host_cpu_us_per_step")
            cols = [[x[k] for x in rs] for k in keys]
            tk = [x["tok_s"] for x in rs]
            hashes = sorted({x["output_hash"] for x in rs})
            line = "".join(f"   {statistics.median(c):8.1f} / {min(c):8.1f}" for c in cols)
            print(
                f"{case:11} {label:5}{line}   {statistics.median(tk):7.1f} / {max(tk):7.1f}"
                f"   {hashes}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/host_overhead"))
    p.add_argument("--cases", nargs="+", choices=CASES, default=["b1", "b8", "b8-overlap", "spec"])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ab", nargs="+", metavar="LABEL=PYTHONPATH")
    p.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"),
        help="cuda: the triton attention backend, CUDA graphs off (the eager diagnostic)",
    )  # fmt: skip
    p.add_argument("--profile", help="write a cProfile of the engine steps of --cases[0] here")
    p.add_argument(
        "--count-syncs", action="store_true",
        help="count per step the calls that would wait for a CUDA device or copy from the host"
        " (item, tolist, bool, nonzero, masked indexing, .to/.copy_, factories), by call site",
    )  # fmt: skip
    p.add_argument("--host-only", action="store_true", help="--profile leaves the model out")
    args = p.parse_args()
    model, head = build_models(args.workdir, args.layers)
    if args.ab:
        ab(args)
    elif args.count_syncs:
        for case in args.cases:
            print(json.dumps(count_syncs(model, head, case, args.tokens, args.device)), flush=True)
    elif args.profile:
        profile(model, head, args.cases[0], args.tokens, args.profile, args.host_only, args.device)
    else:
        for case in args.cases:
            result = measure(model, head, case, args.tokens, args.repeats, args.device)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
