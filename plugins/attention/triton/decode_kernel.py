"""Paged decode attention (one new token per request) with split-K and GQA, in Triton.

Each request's context is split into ``num_splits`` ranges; one program per (request, KV head,
split) attends all query heads of that KV head's group to its range (K/V rows are read once per
group) and writes a partial output and its log-sum-exp. The splits are then merged: with few
splits by the last program of a (request, KV head) to finish, found with an atomic counter, in
the same launch; with more (small batches) by a second kernel, since the last program's serial
merge of many splits took longer than the second launch (H200, 8B shape: batch 64 with 4
splits 3.56 -> 3.50 ms of attention a step; batch 1 with 16 splits 0.24 -> 0.33 ms). With one
split the program writes the output directly. KV rows are found through the device copy of the
req->token table, so the grid and every buffer depend only on the batch size: the step can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.plugins.attention.triton.attend import LOG2E, attend_blocks, launch_settings

MAX_SPLITS = 16
#: the most splits the last program merges in the partial kernel's launch (more: a second kernel)
MERGE_IN_LAUNCH_SPLITS = 4
#: Launch settings on a GPU, chosen with bench/experiments/gpu_kernels.py on an H200 (KV sweep).
#: bench/decode_sweep.py (the engine's slot layout, CUDA graphs, 2026-12-03) timed 3 splits and
#: 2 stages 9% faster at batch 64 x 1,040-1,270 (252 against 276 us over its three lengths),
#: but the engine A-B (bench/experiments/gpu_env_ab.py, RADIXSERVE_TRITON_DECODE) showed no gain:
#: decode steps 7.25 ms both ways, tok/s within the rounds' spread; so these stay. Neither did the
#: KV heads' launch order, evict-first K/V loads nor an L2 prefetch of o_proj's weight from
#: this launch gain in the engine (2026-12-04, commit ee868b7, bench/HISTORY.md).
#: ``splits`` > 0 fixes the number of splits (0: from ``programs_per_sm``, see num_decode_splits).
GPU_CONFIG = {
    "block_n": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 8, "splits": 0,
}  # fmt: skip


def decode_config(spec: str | None = None) -> dict[str, int]:
    """GPU_CONFIG with the ``key=value,...`` settings of ``spec`` over it (the backend reads
    them from RADIXSERVE_TRITON_DECODE)."""
    return launch_settings(GPU_CONFIG, spec)


@triton.jit
def _merge_splits(
    part_ptrs, lse_ptrs, stride_ps, mask_g, mask_gd,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The group's output from its splits' partials (stored by other programs: read past L1)."""
    offs_s = tl.arange(0, BLOCK_S)
    all_lse = tl.load(
        lse_ptrs[:, None] + offs_s[None, :],
        mask=mask_g[:, None] & (offs_s < NUM_SPLITS)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    top = tl.max(all_lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # padding heads: no split at all
    merged = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        lse = tl.load(lse_ptrs + s, mask=mask_g, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp2(lse - top)  # an empty split has lse = -inf: weight 0
        part = tl.load(part_ptrs + s * stride_ps, mask=mask_gd, other=0.0, cache_modifier=".cg")
        merged += w[:, None] * part
        total += w
    return merged / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _decode_partial_kernel(
    Q, K, V, Table, ReqRows, SeqLens, PartOut, PartLse, Out, Counters,
    sm_scale_log2, window, softcap_log2,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_table,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, MERGE_LAST: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SLIDING: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(ReqRows + b).to(tl.int64)
    if SLIDING:
        # Only the last `window` keys: split from the block holding the first of them.
        base = tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N
    else:
        base = 0
    # NOTE: splits are whole BLOCK_N blocks, so trailing splits of short sequences are empty.
    split_len = tl.cdiv(tl.cdiv(seq_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = base + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    # every query row of a decode sits at position seq_len - 1 (read only with SLIDING)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)
    m_i, l_i, acc = attend_blocks(
        q, q_pos, K, V, Table + row * stride_table, start, end, kvh,
        sm_scale_log2, window, softcap_log2,
        stride_kt, stride_kh, stride_vt, stride_vh,
        BLOCK_G, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, False, UPCAST, PRECISION,
        SLIDING, SOFTCAP,
    )  # fmt: skip
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    mask_gd = mask_g[:, None] & mask_d[None, :]
    out_ptrs = Out + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=mask_gd)
    else:
        part_ptrs = PartOut + b * stride_pb + heads[:, None] * stride_ph + offs_d[None, :]
        lse_ptrs = PartLse + b * stride_lb + heads * stride_lh
        tl.store(part_ptrs + split * stride_ps, out, mask=mask_gd)
        tl.store(lse_ptrs + split, lse, mask=mask_g)
        if MERGE_LAST:
            # Every thread's partial is stored before the counter's release; the program that
            # takes the counter to NUM_SPLITS acquires them all, merges, and resets it.
            tl.debug_barrier()
            counter = Counters + b * tl.num_programs(1) + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
                merged = _merge_splits(part_ptrs, lse_ptrs, stride_ps, mask_g, mask_gd,
                                       BLOCK_G, BLOCK_D, NUM_SPLITS, BLOCK_S)  # fmt: skip
                tl.store(out_ptrs, merged.to(Out.dtype.element_ty), mask=mask_gd)
                tl.atomic_xchg(counter, 0)


@triton.jit
def _decode_reduce_kernel(
    PartOut, PartLse, Out,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        PartLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf")
    )
    w = tl.exp2(lse - tl.max(lse, 0))  # empty splits have lse = -inf: weight 0
    part = tl.load(
        PartOut + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    out_ptr = Out + b * stride_ot + h * stride_oh + offs_d
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=mask_d)


def num_decode_splits(
    batch_size: int, num_kv_heads: int, num_sms: int, config: dict[str, int] | None = None
) -> int:
    """Enough splits for ``programs_per_sm`` programs per multiprocessor, at most MAX_SPLITS
    (or the config's fixed ``splits``)."""
    config = config or GPU_CONFIG
    if config.get("splits"):
        return max(1, min(MAX_SPLITS, config["splits"]))
    want = triton.cdiv(config["programs_per_sm"] * num_sms, max(batch_size * num_kv_heads, 1))
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(want)))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    scale: float,
    block_n: int | None = None,
    page_size: int = 1,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    counters: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> None:
    """q, out: [B, H, D]; k_buf, v_buf: [slots, KVH, D]; table: [rows, max_context] int32 KV slots;
    req_rows, seq_lens: [B] int32 on the device; part_out: [B, H, S, D] and part_lse: [B, H, S]
    float32 scratch, S = the number of splits. With ``page_size`` P > 1 the table's positions
    [k * P, (k + 1) * P) must map to consecutive slots (one page). ``sliding_window`` W > 0:
    each decode sees its last W keys only; ``logit_softcap`` c > 0: scores s -> c tanh(s / c).
    ``counters``: [B, KVH] int32, zero (and left zero), lets the last split of each group merge
    up to MERGE_IN_LAUNCH_SPLITS splits in the same launch (``new_counters``); otherwise a
    second kernel merges them. ``config``: GPU launch settings (default GPU_CONFIG)."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    num_splits = part_out.shape[2]
    on_cpu = q.device.type == "cpu"  # the Triton interpreter (CI)
    config = config or GPU_CONFIG
    block_n = block_n or (16 if on_cpu else config["block_n"])
    precise = on_cpu or q.dtype == torch.float32
    merge_last = counters is not None and merges_in_launch(num_splits)
    _decode_partial_kernel[(bs, num_kv_heads, num_splits)](
        q, k_buf, v_buf, table, req_rows, seq_lens, part_out, part_lse, out,
        counters if merge_last else seq_lens,
        scale * LOG2E, sliding_window, logit_softcap * LOG2E,
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n, NUM_SPLITS=num_splits, PAGE_SIZE=page_size,
        UPCAST=on_cpu, PRECISION="ieee" if precise else "tf32",
        MERGE_LAST=merge_last, BLOCK_S=triton.next_power_of_2(num_splits),
        SLIDING=sliding_window > 0, SOFTCAP=logit_softcap > 0,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    if num_splits == 1 or merge_last:
        return
    _decode_reduce_kernel[(bs, num_heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4,
    )  # fmt: skip


def merges_in_launch(num_splits: int) -> bool:
    """Whether ``decode_attention`` given counters merges this many splits in its own launch."""
    return 1 < num_splits <= MERGE_IN_LAUNCH_SPLITS


def new_counters(batch_size: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The zeroed merge counters ``decode_attention`` takes (it leaves them zeroed)."""
    return torch.zeros((batch_size, num_kv_heads), dtype=torch.int32, device=device)
