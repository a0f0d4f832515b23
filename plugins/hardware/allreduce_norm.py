"""One kernel for tensor parallelism's all-reduce and the residual add + RMSNorm after it.

In a decoder layer every row-parallel output (o_proj, down_proj) is all-reduced and then joins
the residual stream through add + RMSNorm: two kernels, each a few microseconds of a decode
step's latency, 64 times per step on an 8B model. Here one kernel does both, one program per
row:

1. store this rank's partial row into its slot of a buffer every rank mapped (symmetric memory);
2. barrier with the peers for this row: set a flag in each peer's flag array (compare-and-swap
   0 -> 1, release, system scope), wait for each peer's flag in ours (1 -> 0, acquire): the
   flags are back at 0 afterwards, so a CUDA graph can replay the kernel as often as it likes;
3. sum the ranks' rows in rank order (the same float32 sum on every rank: bit-identical
   results), round as the all-reduce would, add the residual, round, normalize.

Each call site owns a slot (``site``: 0 after o_proj, 1 after down_proj). Two calls in a row
always use different slots, so a rank that runs ahead into the next call never overwrites a row
a slower peer is still reading; any other collective between two calls of one site (the
embedding's all-reduce, the logits gather, an all-reduce NCCL does) is itself a barrier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _allreduce_add_rms_norm_kernel(
    X, R, W, Out, Total, DataPtrs, FlagPtrs,
    stride_x, stride_r, stride_o, stride_t, N, eps, rank, data_offset, src_stride, flag_offset,
    spin_limit, WORLD: tl.constexpr, BLOCK: tl.constexpr, PUSH: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = Out.dtype.element_ty
    ptr_ty = tl.pointer_type(dtype)
    x = tl.load(X + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    if PUSH:  # into each peer's buffer, at this rank's slot: the peers then read locally
        for r in tl.static_range(WORLD):
            if r != rank:
                dst = tl.load(DataPtrs + r).to(ptr_ty) + data_offset + rank * src_stride
                tl.store(dst + row.to(tl.int64) * N + offs, x.to(dtype), mask=mask)
    else:  # into this rank's own buffer: the peers read it over NVLink
        mine = tl.load(DataPtrs + rank).to(ptr_ty) + data_offset + row.to(tl.int64) * N
        tl.store(mine + offs, x.to(dtype), mask=mask)
    tl.debug_barrier()  # every thread's store is done before the flag below is raised
    my_flags = tl.load(FlagPtrs + rank).to(tl.pointer_type(tl.int32)) + flag_offset + row * WORLD
    # spin_limit: -1 waits for ever (a step's peer may be seconds late, e.g. compiling a
    # kernel); the start-up self-test gives up after that many tries and returns NaN
    spins = 0
    for r in tl.static_range(WORLD):
        if r != rank:
            peer_flags = tl.load(FlagPtrs + r).to(tl.pointer_type(tl.int32))
            flag = peer_flags + flag_offset + row * WORLD + rank
            while (tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0) & (
                spins != spin_limit
            ):
                spins += 1
    for r in tl.static_range(WORLD):
        if r != rank:
            while (tl.atomic_cas(my_flags + r, 1, 0, sem="acquire", scope="sys") != 1) & (
                spins != spin_limit
            ):
                spins += 1
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == rank:
            acc += x.to(dtype).to(tl.float32)
        else:
            if PUSH:
                src = tl.load(DataPtrs + rank).to(ptr_ty) + data_offset + r * src_stride
            else:
                src = tl.load(DataPtrs + r).to(ptr_ty) + data_offset
            src += row.to(tl.int64) * N
            acc += tl.load(src + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    # as the all-reduce then add_rms_norm would round: the sum, the new stream, the norm
    res = tl.load(R + row.to(tl.int64) * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.where(spins == spin_limit, float("nan"), acc)
    total = (acc.to(dtype).to(tl.float32) + res).to(dtype)
    tl.store(Total + row.to(tl.int64) * stride_t + offs, total, mask=mask)
    t = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(t * t, 0) / N + eps)
    normed = (t * rstd).to(dtype).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row.to(tl.int64) * stride_o + offs, (w * normed).to(dtype), mask=mask)


def allreduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    data_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    rank: int,
    world: int,
    data_offset: int,
    flag_offset: int,
    spin_limit: int = -1,
    push: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum_ranks(x) + residual), sum_ranks(x) + residual) for x, residual: [T, N].
    ``data_ptrs``/``flag_ptrs``: int64 device tensors of every rank's buffer and flag array
    addresses; ``data_offset`` (elements of x's dtype) and ``flag_offset`` (int32s) pick the
    call site's slot. ``spin_limit``: tries at each flag before giving up with NaN results
    (-1: none; a self-test's guard against a peer that never answers). ``push``: write this
    rank's rows into every peer's buffer (at slot ``rank``, ``world`` slots of x's size from
    ``data_offset``) and read the peers' from its own, instead of each rank's rows staying
    in its own buffer for the peers to read (one NVLink crossing instead of a round trip)."""
    out = torch.empty_like(x)
    total = torch.empty_like(x)
    rows, n = x.shape
    if rows == 0:
        return out, total
    block = triton.next_power_of_2(n)
    _allreduce_add_rms_norm_kernel[(rows,)](
        x, residual, weight, out, total, data_ptrs, flag_ptrs,
        x.stride(0), residual.stride(0), out.stride(0), total.stride(0), n, eps, rank,
        data_offset, rows * n, flag_offset, spin_limit, WORLD=world, BLOCK=block, PUSH=push,
        num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return out, total


# ---- the flagless (Lamport) variant ----------------------------------------------------------
#
# No flags: a slot of the receive buffer holds a sentinel (-0.0's bits) until the peer's row
# lands in it, and each thread polls its own elements until none is the sentinel (a real -0.0
# is sent as +0.0: the same in any sum). One NVLink crossing, no barrier round trip. Each row
# keeps a call counter on the device; call c of a row uses stage c % 3 of the buffer and clears
# the stage of the call before it, which no peer can write again before this rank's next row
# has reached it (a peer is at most one call ahead: it needs this rank's rows to finish one).
# The counters live in device memory, so graph replays advance them like eager calls.

#: bits of -0.0 in bfloat16 (the only dtype this variant takes), the empty slot's mark
SENTINEL_BF16 = -32768  # 0x8000 as int16


@triton.jit
def _lamport_add_rms_norm_kernel(
    X, R, W, Out, Total, DataPtrs, Counters,
    stride_x, stride_r, stride_o, stride_t, N, eps, rank, stage_stride, slot_stride,
    spin_limit, WORLD: tl.constexpr, BLOCK: tl.constexpr, SENTINEL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = Out.dtype.element_ty
    bits_ty = tl.pointer_type(tl.int16)
    count = tl.load(Counters + row)
    stage = count % 3
    x = tl.load(X + row64 * stride_x + offs, mask=mask, other=0.0).to(dtype)
    xb = x.to(tl.int16, bitcast=True)
    xb = tl.where(xb == SENTINEL, 0, xb)  # -0.0 -> +0.0: the sentinel is never sent
    here = stage.to(tl.int64) * stage_stride + rank * slot_stride + row64 * N
    for r in tl.static_range(WORLD):
        if r != rank:
            dst = tl.load(DataPtrs + r).to(bits_ty) + here
            tl.store(dst + offs, xb, mask=mask)
    mine = tl.load(DataPtrs + rank).to(bits_ty)
    spins = 0
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == rank:
            acc += xb.to(dtype, bitcast=True).to(tl.float32)
        else:
            src = mine + stage.to(tl.int64) * stage_stride + r * slot_stride + row64 * N + offs
            v = tl.load(src, mask=mask, other=0, volatile=True)
            while (tl.max(((v == SENTINEL) & mask).to(tl.int32), 0) > 0) & (spins != spin_limit):
                v = tl.load(src, mask=mask, other=0, volatile=True)
                spins += 1
            acc += v.to(dtype, bitcast=True).to(tl.float32)
    # the previous call's stage is empty again for the call after next
    prev = ((stage + 2) % 3).to(tl.int64) * stage_stride + row64 * N
    for r in tl.static_range(WORLD):
        if r != rank:
            tl.store(mine + prev + r * slot_stride + offs, tl.full([BLOCK], SENTINEL, tl.int16),
                     mask=mask)  # fmt: skip
    tl.store(Counters + row, count + 1)
    res = tl.load(R + row64 * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.where(spins == spin_limit, float("nan"), acc)
    total = (acc.to(dtype).to(tl.float32) + res).to(dtype)
    tl.store(Total + row64 * stride_t + offs, total, mask=mask)
    t = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(t * t, 0) / N + eps)
    normed = (t * rstd).to(dtype).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row64 * stride_o + offs, (w * normed).to(dtype), mask=mask)


def lamport_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    data_ptrs: torch.Tensor,
    counters: torch.Tensor,
    rank: int,
    world: int,
    max_rows: int,
    spin_limit: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``allreduce_add_rms_norm`` without flags, bfloat16 only. Every rank's buffer
    (``data_ptrs``) holds 3 stages x ``world`` slots x ``max_rows`` rows of x's width, filled
    with SENTINEL_BF16 at the start; ``counters``: this rank's int32 call count per row
    (zeros at the start)."""
    out = torch.empty_like(x)
    total = torch.empty_like(x)
    rows, n = x.shape
    if rows == 0:
        return out, total
    block = triton.next_power_of_2(n)
    slot = max_rows * n
    _lamport_add_rms_norm_kernel[(rows,)](
        x, residual, weight, out, total, data_ptrs, counters,
        x.stride(0), residual.stride(0), out.stride(0), total.stride(0), n, eps, rank,
        world * slot, slot, spin_limit, WORLD=world, BLOCK=block, SENTINEL=SENTINEL_BF16,
        num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return out, total
