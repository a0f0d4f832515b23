"""Micro-benchmarks of a tensor-parallel decode step's parts, run inside bench/tp.py's
``collectives`` ranks (one process per GPU, the group initialised): which change would pay.

- ``fused_norm_check``: the fused all-reduce + add + RMSNorm kernel
  (plugins/hardware/allreduce_norm.py) against NCCL's all-reduce then the Triton add_rms_norm,
  on random rows: the largest difference, every rank's result the same;
- ``gemv_shapes``: each per-rank weight shape of a batch-1 step (qkv, o, gate_up, down, LM
  head) through cuBLAS (``F.linear``, what the model runs) and a plain Triton GEMV, 32 distinct
  weights back to back in a CUDA graph (so L2 holds none of them): us per call and GB/s;
- ``skeleton_norm``: the GEMV skeleton of a step with what follows each row-parallel output:
  add_rms_norm alone, one-shot all-reduce + add_rms_norm, the fused kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LAYERS = 32


def graph_us(run: Callable[[], Any], reps: int = 20) -> float:
    """Median us of one replay of ``run`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    torch.cuda.synchronize()
    graph.reset()
    times.sort()
    return times[len(times) // 2]


def fused_norm_check(rank: int, size: int, device: str, fast: Any) -> dict[str, Any]:
    """Each mode of the kernel (pull: peers read this rank's buffer; push: it writes theirs;
    lamport: no flags)."""
    res: dict[str, Any] = {}
    before = fast.mode
    for mode in ("pull", "push", "lamport"):
        fast.mode = mode
        if not _works(fast, rank, size, device):  # bounded waits first: a hang costs the phase
            res[f"fused_norm_{mode}_works"] = False
            continue
        try:
            part = _fused_norm_check(rank, size, device, fast)
        except Exception as e:  # noqa: BLE001 - recorded; the other modes still run
            part = {"fused_norm_error": f"{type(e).__name__}: {e}"[:300]}
        res.update({k.replace("fused_norm", f"fused_norm_{mode}"): v for k, v in part.items()})
    fast.mode = before
    return res


def _works(fast: Any, rank: int, size: int, device: str) -> bool:
    """The kernel in its current mode, with bounded waits, gives the right sums on every rank."""
    import torch.distributed as dist

    from radixserve.plugins.hardware.cuda_allreduce import SELF_TEST_SPINS

    x = torch.full((2, 4096), float(rank + 1), device=device, dtype=torch.bfloat16)
    ok = True
    for site in (0, 1, 0, 1):
        got = fast.add_rms_norm(x, torch.zeros_like(x), torch.ones_like(x[0]), 1e-5, site,
                                spin_limit=SELF_TEST_SPINS)  # fmt: skip
        ok = ok and got is not None and bool((got[1] == size * (size + 1) / 2).all())
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _fused_norm_check(rank: int, size: int, device: str, fast: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from radixserve.plugins.models import fused_ops

    res: dict[str, Any] = {}
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    for rows in (1, 8, 256):
        x = torch.randn(rows, 4096, device=device, generator=gen).to(torch.bfloat16)
        resid = torch.randn(rows, 4096, device=device, generator=gen).to(torch.bfloat16)
        dist.broadcast(resid, 0)  # the residual stream is the same on every rank
        w = (torch.rand(4096, device=device, generator=gen) + 0.5).to(torch.bfloat16)
        dist.broadcast(w, 0)
        ref_sum = x.clone()
        dist.all_reduce(ref_sum)
        ref_out, ref_total = fused_ops.add_rms_norm(ref_sum, resid, w, 1e-5)
        got = fast.add_rms_norm(x, resid, w, 1e-5, rows % 2)
        if got is None:
            res[f"fused_norm_{rows}_taken"] = False
            continue
        out, total = got
        res[f"fused_norm_{rows}_max_diff_out"] = (out.float() - ref_out.float()).abs().max().item()
        res[f"fused_norm_{rows}_max_diff_total"] = (
            (total.float() - ref_total.float()).abs().max().item()
        )
        res[f"fused_norm_{rows}_equal_frac"] = (out == ref_out).float().mean().item()
        other = out.clone()
        dist.broadcast(other, 0)
        res[f"fused_norm_{rows}_ranks_identical"] = bool((other == out).all())
    # many calls in a row, alternating sites, from a graph: still the right sums
    x = torch.full((1, 4096), float(rank + 1), device=device, dtype=torch.bfloat16)
    resid = torch.zeros(1, 4096, device=device, dtype=torch.bfloat16)
    w = torch.ones(4096, device=device, dtype=torch.bfloat16)
    outs: list[torch.Tensor] = []

    def chain() -> None:
        outs.clear()
        for i in range(64):
            outs.append(fast.add_rms_norm(x, resid, w, 1e-5, i % 2)[1])

    res["fused_norm_chain_graph_us"] = graph_us(chain) / 64
    chain()  # once more, eagerly: the graph's outputs went with it
    torch.cuda.synchronize()
    want = size * (size + 1) / 2
    res["fused_norm_chain_correct"] = all(bool((t == want).all()) for t in outs)
    return res


def triton_gemv(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, cfg: tuple[int, int, int]):
    """The engine's kernel (plugins/hardware/gemv.py) on x [K] (or [2K] with silu: cfg[3])."""
    from radixserve.plugins.hardware.gemv import _gemv_kernel as engine_kernel

    bn, bk, warps = cfg[:3]
    silu = len(cfg) > 3 and bool(cfg[3])
    n, k = w.shape
    engine_kernel[(n // bn,)](x, w, y, n, k, w.stride(0), SILU=silu, BLOCK_N=bn, BLOCK_K=bk,
                              num_warps=warps)  # fmt: skip


GEMV_CONFIGS = [(4, 1024, 4), (16, 256, 4), (8, 512, 4), (2, 2048, 4), (4, 2048, 8), (8, 1024, 8),
                (16, 512, 8), (32, 256, 8)]  # fmt: skip


def gemv_shapes(c: dict[str, Any], tp: int, device: str) -> dict[str, Any]:
    """us per call and GB/s of each per-rank shape at ``tp``, cuBLAS and Triton."""
    h, inter = c["hidden_size"], c["intermediate_size"]
    d = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"qkv": ((q + 2 * kv) // tp, h), "o": (h, q // tp),
              "gate_up": (2 * inter // tp, h), "down": (h, inter // tp),
              "lm_head": (-(-c["vocab_size"] // tp), h)}  # fmt: skip
    res: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        count = LAYERS if name != "lm_head" else 4
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.01 for _ in range(count)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        y = torch.empty(n, device=device, dtype=torch.bfloat16)
        gb = n * k * 2 / 1e9
        us = graph_us(lambda ws=ws, x=x: [F.linear(x, w) for w in ws]) / count
        res[f"gemv_tp{tp}_{name}_cublas_us"] = us
        res[f"gemv_tp{tp}_{name}_cublas_GBps"] = gb / us * 1e6
        best = None
        configs: list[tuple[int, ...]] = list(GEMV_CONFIGS)
        if name == "down":  # SiLU(gate) * up inside, the input [gate | up]
            configs += [(*c, 1) for c in GEMV_CONFIGS]
        gu = torch.randn(1, 2 * k, device=device, dtype=torch.bfloat16)
        all_us = res.setdefault(f"gemv_tp{tp}_{name}_triton_all_us", {})
        for cfg in configs:
            if n % cfg[0] or k % cfg[1]:
                continue
            silu = len(cfg) > 3
            src = gu if silu else x
            try:
                if silu:
                    from radixserve.plugins.models.fused_ops import silu_mul

                    ref = F.linear(silu_mul(gu), ws[0])[0]
                else:
                    ref = F.linear(x, ws[0])[0]
                triton_gemv(ws[0], src[0], y, cfg)
                if not torch.allclose(y.float(), ref.float(), atol=2e-2, rtol=2e-2):
                    res[f"gemv_tp{tp}_{name}_triton_{cfg}_wrong"] = True
                    continue
                t = graph_us(lambda ws=ws, src=src, y=y, cfg=cfg: [
                    triton_gemv(w, src[0], y, cfg) for w in ws]) / count  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a config that does not compile
                res[f"gemv_tp{tp}_{name}_triton_error"] = f"{type(e).__name__}: {e}"[:200]
                continue
            all_us[",".join(map(str, cfg))] = round(t, 2)
            if not silu and (best is None or t < best[0]):
                best = (t, cfg)
        if best is not None:
            res[f"gemv_tp{tp}_{name}_triton_us"] = best[0]
            res[f"gemv_tp{tp}_{name}_triton_cfg"] = list(best[1])
            res[f"gemv_tp{tp}_{name}_triton_GBps"] = gb / best[0] * 1e6
        del ws
        torch.cuda.empty_cache()
    return res


def skeleton_norm(
    c: dict[str, Any], tp: int, device: str, fast: Any, barrier: Callable[[], Any]
) -> dict[str, Any]:
    """ms of a batch-1 step's GEMVs plus what follows each row-parallel output."""
    from radixserve.plugins.models import fused_ops

    h, inter = c["hidden_size"], c["intermediate_size"]
    d = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, dtype=torch.bfloat16, device=device) * 0.01

    layers = [(w((q + 2 * kv) // tp, h), w(h, q // tp), w(2 * inter // tp, h),
               w(h, inter // tp)) for _ in range(c["num_hidden_layers"])]  # fmt: skip
    norm_w = torch.ones(h, dtype=torch.bfloat16, device=device)
    x0 = torch.randn(1, h, dtype=torch.bfloat16, device=device) * 0.01

    def join(kind: str, part: torch.Tensor, resid: torch.Tensor, site: int):
        if kind.startswith("fused"):
            return fast.add_rms_norm(part, resid, norm_w, 1e-5, site)
        if kind == "oneshot":
            fast(part)
        return fused_ops.add_rms_norm(part, resid, norm_w, 1e-5)

    def step(kind: str) -> Callable[[], Any]:
        def run() -> Any:
            x, resid = x0, x0
            for qkv_w, o_w, gu_w, down_w in layers:
                qkv = F.linear(x, qkv_w)
                o = F.linear(qkv[:, : o_w.shape[1]].contiguous(), o_w)
                x, resid = join(kind, o, resid, 0)
                gu = F.linear(x, gu_w)
                down = F.linear(gu[:, : down_w.shape[1]].contiguous(), down_w)
                x, resid = join(kind, down, resid, 1)
            return x

        return run

    res: dict[str, Any] = {}
    for kind in ("norm_only", "oneshot", "fused", "fused_push", "fused_lamport"):
        if kind != "norm_only" and fast is None:
            continue
        if kind.startswith("fused") and fast.add_rms_norm(x0, x0, norm_w, 1e-5, 0) is None:
            continue
        barrier()
        if kind.startswith("fused"):
            before, fast.mode = fast.mode, kind.removeprefix("fused_") if "_" in kind else "pull"
            works = _works(fast, torch.distributed.get_rank(), tp, device)
        if not kind.startswith("fused") or works:
            res[f"skeleton_tp{tp}_{kind}_ms"] = graph_us(step(kind)) / 1e3
        if kind.startswith("fused"):
            fast.mode = before
    barrier()
    return res


@triton.jit
def _prefetch_kernel(P, N, Sink, BLOCK: tl.constexpr):
    """Read P[0:N] (bfloat16) into L2 and keep it there (evict_last); stores nothing unless
    the sum is a value no weights give (so the loads are not optimised away)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, N, step):
        idx = start + offs
        acc += tl.load(P + idx, mask=idx < N, other=0.0, eviction_policy="evict_last").to(
            tl.float32
        )
    total = tl.sum(acc, 0)
    if total == 123456.0:
        tl.store(Sink, total)


def prefetch(w: torch.Tensor, nbytes: int, sink: torch.Tensor, programs: int) -> None:
    n = min(w.numel(), nbytes // w.element_size())
    _prefetch_kernel[(programs,)](w, n, sink, BLOCK=2048, num_warps=4)


def skeleton_prefetch(c: dict[str, Any], tp: int, device: str) -> dict[str, Any]:
    """One GPU, this rank's TP shapes: a batch-1 step's GEMVs with stand-ins for the small
    kernels between them (add_rms_norm on one row: 4 after qkv for rope/store/attention, 1
    after o for the fused all-reduce, 1 after gate_up for silu_mul, 1 after down), against the
    same with the next GEMV's weights read into L2 on a side stream during those windows
    (``budget`` MB at most each time). Tells whether prefetching pays in the idle gaps."""
    from radixserve.plugins.models import fused_ops

    h, inter = c["hidden_size"], c["intermediate_size"]
    d = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, dtype=torch.bfloat16, device=device) * 0.01

    layers = [(w((q + 2 * kv) // tp, h), w(h, q // tp), w(2 * inter // tp, h),
               w(h, inter // tp)) for _ in range(c["num_hidden_layers"])]  # fmt: skip
    norm_w = torch.ones(h, dtype=torch.bfloat16, device=device)
    x0 = torch.randn(1, h, dtype=torch.bfloat16, device=device) * 0.01
    sink = torch.zeros(1, dtype=torch.float32, device=device)
    side = torch.cuda.Stream(device)

    def small(x: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            x = fused_ops.add_rms_norm(x, x0, norm_w, 1e-5)[0]
        return x

    def step(budget_mb: float, programs: int, join: bool) -> Callable[[], Any]:
        nbytes = int(budget_mb * 1e6)

        def fetch(t: torch.Tensor) -> Any:
            if not nbytes:
                return None
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(t, nbytes, sink, programs)
            return True

        forked = []

        def joined(started: Any) -> None:
            if started:
                forked.append(True)
            if started and join:
                torch.cuda.current_stream().wait_stream(side)

        def run() -> Any:
            forked.clear()
            x = x0
            for i, (qkv_w, o_w, gu_w, down_w) in enumerate(layers):
                qkv = F.linear(x, qkv_w)
                f = fetch(o_w)
                a = small(qkv[:, : o_w.shape[1]].contiguous(), 4)
                joined(f)
                o = F.linear(a, o_w)
                f = fetch(gu_w)
                x = small(o, 1)
                joined(f)
                gu = F.linear(x, gu_w)
                f = fetch(down_w)
                x = small(gu[:, : down_w.shape[1]].contiguous(), 1)
                joined(f)
                down = F.linear(x, down_w)
                f = fetch(layers[(i + 1) % len(layers)][0])
                x = small(down, 1)
                joined(f)
            if forked:  # a stream that never forked from this one must not be joined in a capture
                torch.cuda.current_stream().wait_stream(side)
            return x

        return run

    res: dict[str, Any] = {}
    for budget, programs, join in ((0, 0, True), (8, 32, True), (16, 32, True), (16, 64, True),
                                   (32, 64, True), (16, 32, False), (32, 64, False)):  # fmt: skip
        key = f"prefetch_tp{tp}_{budget}MB_{programs}p_{'join' if join else 'nojoin'}_ms"
        res[key] = graph_us(step(budget, programs, join)) / 1e3
    layers.clear()
    torch.cuda.empty_cache()
    return res
