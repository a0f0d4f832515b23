#!/usr/bin/env python
"""HiCache's host copies alone: HostKVPool.backup and load of N tokens (default 4096) between a
device KV pool and the host pool, per layout, against a ceiling measured in the same run (one
contiguous copy of the same bytes between pinned host memory and the device, each way; on the
CPU a contiguous copy between two tensors). Host slots come in pages of --page (shuffled pages
with --order shuffled, as a long-running host pool hands them out), device slots are
scattered. Rows named ``indexed`` time the copies as HostKVPool made them before they went by
runs (per layer an indexed gather, a blocking ``.cpu()`` / a pageable upload, an indexed
scatter), for the before/after ratio on the same machine.

    # the next session's first GPU run (Llama-3.1-8B's KV shape, bfloat16):
    PYTHONPATH=bench python bench/experiments/hicache_copies.py --device cuda --shape llama3-8b
    # the CPU, float32, the same shape (the run helper and the staging, no PCIe):
    PYTHONPATH=bench python bench/experiments/hicache_copies.py --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import format_table, machine_info, write_json  # noqa: E402
from gpu_model import SHAPES  # noqa: E402

from radixserve.core.hicache_pool import HostKVPool, slot_runs  # noqa: E402
from radixserve.core.memory import KVPool  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="default: the shape's")
    p.add_argument("--heads", type=int, default=None, help="KV heads; default: the shape's")
    p.add_argument("--head-dim", type=int, default=None, help="default: the shape's")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per backup / load")
    p.add_argument("--page", type=int, default=16, help="host pool page size")
    p.add_argument("--order", nargs="+", default=["in-order", "shuffled"],
                   choices=["in-order", "shuffled"], help="host page order")  # fmt: skip
    p.add_argument("--io-backend", default=None, help="default: kernel on cuda, direct on cpu")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-indexed", action="store_true", help="skip the before-runs rows")
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_s(fn: Callable[[], Any], device: str, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        begin = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def ceilings(nbytes: int, device: str, reps: int) -> dict[str, float]:
    """GB/s of one contiguous copy of ``nbytes`` host -> device and device -> host."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = median_s(lambda: dev.copy_(host, non_blocking=True), device, reps)
    d2h = median_s(lambda: host.copy_(dev, non_blocking=True), device, reps)
    return {"load": nbytes / h2d / 1e9, "backup": nbytes / d2h / 1e9}


def indexed_backup(host: HostKVPool, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
    """The copies before runs: per layer a device gather, a blocking .cpu(), a host scatter."""
    dev = host.device_pool
    index = device_slots.to(dev.k[0].device)
    for layer in range(host.num_layers):
        k = dev.k[layer].index_select(0, index).cpu()
        v = dev.v[layer].index_select(0, index).cpu()
        if host.layout == "page_first":
            host.buf[:, layer, 0].index_copy_(0, host_slots, k)
            host.buf[:, layer, 1].index_copy_(0, host_slots, v)
        else:
            host.k[layer].index_copy_(0, host_slots, k)
            host.v[layer].index_copy_(0, host_slots, v)


def indexed_load(host: HostKVPool, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
    """The copies before runs: per layer a host gather into pageable memory, an upload, a
    device scatter."""
    dev = host.device_pool
    device = dev.k[0].device
    index = device_slots.to(device)
    for layer in range(host.num_layers):
        if host.layout == "page_first":
            k = host.buf[:, layer, 0].index_select(0, host_slots)
            v = host.buf[:, layer, 1].index_select(0, host_slots)
        else:
            k = host.k[layer].index_select(0, host_slots)
            v = host.v[layer].index_select(0, host_slots)
        dev.k[layer].index_copy_(0, index, k.to(device, non_blocking=True))
        dev.v[layer].index_copy_(0, index, v.to(device, non_blocking=True))


def copy_ways(
    host: HostKVPool, host_slots: torch.Tensor, device_slots: torch.Tensor, indexed: bool
) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """(name, backup, load) per way to time: by runs (CUDA's default), by a host gather /
    scatter (the CPU's default; on CUDA a backup never scatters, so it is the runs one), and
    the indexed copies from before runs."""

    def backup(max_runs: int) -> None:
        host.run_copy_max_runs = max_runs
        host.backup(device_slots, host_slots)

    def load(max_runs: int) -> None:
        host.run_copy_max_runs = max_runs
        host.load(host_slots, device_slots)

    ways = [("runs", partial(backup, 1 << 30), partial(load, 1 << 30))]
    ways.append(("gather", partial(backup, 0), partial(load, 0)))
    if indexed:
        ways.append((
            "indexed",
            partial(indexed_backup, host, device_slots, host_slots),
            partial(indexed_load, host, host_slots, device_slots),
        ))  # fmt: skip
    return ways


def slots(args: argparse.Namespace, shuffled: bool, gen: torch.Generator) -> torch.Tensor:
    """``args.tokens`` slots of a pool twice that size: whole pages, in order or shuffled."""
    pages = 2 * args.tokens // args.page
    order = torch.randperm(pages, generator=gen) if shuffled else torch.arange(pages)
    picked = order[: args.tokens // args.page] + 1  # page 0 pads
    return (picked[:, None] * args.page + torch.arange(args.page)).flatten()


def main() -> None:
    args = parse_args()
    shape = SHAPES[args.shape]
    layers = args.layers or shape["num_hidden_layers"]
    heads = args.heads or shape["num_key_value_heads"]
    head_dim = args.head_dim or shape["hidden_size"] // shape["num_attention_heads"]
    dtype = getattr(torch, args.dtype)
    io_backend = args.io_backend or ("kernel" if args.device == "cuda" else "direct")
    args.tokens -= args.tokens % args.page
    size = 2 * args.tokens + args.page
    dev = KVPool(size, layers, heads, head_dim, dtype, args.device)
    nbytes = args.tokens * HostKVPool.bytes_per_token(dev)
    ceiling = ceilings(nbytes, args.device, args.reps)
    gen = torch.Generator().manual_seed(0)
    device_slots = torch.randperm(size, generator=gen)[: args.tokens] + 1
    rows, results = [], []
    for layout in ("layer_first", "page_first"):
        host = HostKVPool(dev, size, args.page, layout, io_backend)
        for order in args.order:
            host_slots = slots(args, order == "shuffled", gen)
            runs = len(slot_runs(host_slots))
            ways = copy_ways(host, host_slots, device_slots, indexed=not args.no_indexed)
            for name, backup, load in ways:
                for op, fn in (("backup", backup), ("load", load)):
                    if op == "backup" and name == "gather" and args.device == "cuda":
                        continue  # the same as by runs: backups scatter on the host on the CPU only
                    gbps = nbytes / median_s(fn, args.device, args.reps) / 1e9
                    share = gbps / ceiling[op]
                    rows.append([layout, order, runs, name, op, f"{gbps:.2f}", f"{share:.2f}"])
                    results.append(dict(layout=layout, order=order, runs=runs, way=name, op=op,
                                        GBps=gbps, of_ceiling=share))  # fmt: skip
    print(f"{args.tokens} tokens, {layers} layers x {heads} heads x {head_dim} dim, {args.dtype}"
          f", {nbytes / 1e6:.0f} MB a copy; {args.device}, io backend {io_backend}; ceiling: "
          f"load {ceiling['load']:.2f} GB/s, backup {ceiling['backup']:.2f} GB/s")  # fmt: skip
    default = "runs (layer_first: gather past 8)" if args.device == "cuda" else "gather"
    print(f"HostKVPool's default way on {args.device}: {default}")
    headers = ["layout", "host pages", "runs", "way", "op", "GB/s", "of ceiling"]
    print(format_table(headers, rows))
    if args.json_out:
        write_json(args.json_out, dict(args=vars(args), machine=machine_info(),
                                       ceiling_GBps=ceiling, results=results))  # fmt: skip


if __name__ == "__main__":
    main()
