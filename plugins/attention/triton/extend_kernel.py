"""Paged extend (prefill) attention in Triton: each request's new tokens attend, causally, to its
cached prefix and to the new tokens up to themselves.

One program per (request, query head, block of BLOCK_M new tokens), or with PACK_GQA per
(request, KV head, block of BLOCK_M (new token, query head) rows). K/V of the prefix and of the
new tokens are both read from the pool through the device req->token table: the backend stores
the new K/V before it attends, so one pass covers both. The keys before a query block's first
row are visible to all its rows and are attended without the causal mask; only the blocks from
there on apply it (SPLIT_MASK). The query blocks are launched last block first (HEAVY_FIRST):
with the causal mask a request's last block has the most keys, and started last it would run
alone at the end of the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.plugins.attention.triton.attend import (
    LOG2E,
    attend_blocks,
    attend_more,
    launch_settings,
)

#: Launch settings on a GPU (``block`` given to ``extend_attention`` overrides both blocks).
#: bench/extend_sweep.py on an H200 (8B heads, 8 x 1,024 new tokens over 0 and 1,024 cached)
#: found 3 stages 4% and 11% faster, but it was not adopted: prefill attention is ~6% of the
#: 64 x (1,024 + 256) prefill, and 3 stages of 64-row K and V tiles take 96 KB of shared memory
#: at head size 128 (192 KB at 256), about all that smaller GPUs have (bench/HISTORY.md).
#: The loop switches, timed in CUDA graphs (``--grid flags``, 2026-12-03): last block first
#: (``heavy_first``) 230 -> 231 and 242 -> 250 TFLOP/s at these settings (247 -> 248 and
#: 278 -> 280 with 3 stages), so it is on; the unmasked pass (``split_mask``) 230 -> 207 and
#: 242 -> 228 at 64 x 64 (two pipelined loops of few blocks each), about even with 128-row
#: query blocks (293 -> 295 over a cached prefix; 305 with both switches), so it is off.
GPU_CONFIG = {
    "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2,
    "heavy_first": True, "split_mask": False,
}  # fmt: skip


def extend_config(spec: str | None = None) -> dict[str, int]:
    """GPU_CONFIG with the ``key=value,...`` settings of ``spec`` over it (the backend reads
    them from RADIXSERVE_TRITON_EXTEND)."""
    return launch_settings(GPU_CONFIG, spec)


CPU_CONFIG = {
    "block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2,
    "heavy_first": True, "split_mask": True,
}  # fmt: skip


@triton.jit
def _extend_kernel(
    Q, K, V, Out, Table, ReqRows, SeqLens, ExtLens, QStarts,
    sm_scale_log2, window, softcap_log2,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SLIDING: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    HEAVY_FIRST: tl.constexpr = False, SPLIT_MASK: tl.constexpr = False,
    PACK_GQA: tl.constexpr = False,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)  # the query head; with PACK_GQA the KV head
    if HEAVY_FIRST:
        mblk = tl.num_programs(2) - 1 - tl.program_id(2)
    else:
        mblk = tl.program_id(2)
    row = tl.load(ReqRows + r).to(tl.int64)
    seq_len = tl.load(SeqLens + r)
    ext_len = tl.load(ExtLens + r)
    q_start = tl.load(QStarts + r).to(tl.int64)
    prefix = seq_len - ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    if PACK_GQA:
        # a block's rows are (new token, query head of the KV head's group) pairs, GROUP rows a
        # token: the group's heads share each K/V block read (a decode row's GROUP heads in one
        # program instead of GROUP programs); a row's arithmetic is the unpacked one's
        kvh = h
        offs_p = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_m = offs_p // GROUP
        q_rows = (q_start + offs_m)[:, None] * stride_qt + (h * GROUP + offs_p % GROUP)[
            :, None
        ] * stride_qh
        o_rows = (q_start + offs_m)[:, None] * stride_ot + (h * GROUP + offs_p % GROUP)[
            :, None
        ] * stride_oh
        first = mblk * BLOCK_M // GROUP  # the block's first and last new token
        last = ((mblk + 1) * BLOCK_M - 1) // GROUP
    else:
        kvh = h // GROUP
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        q_rows = (q_start + offs_m)[:, None] * stride_qt + h * stride_qh
        o_rows = (q_start + offs_m)[:, None] * stride_ot + h * stride_oh
        first = mblk * BLOCK_M
        last = (mblk + 1) * BLOCK_M - 1
    mask_m = offs_m < ext_len
    q_pos = prefix + offs_m
    q = tl.load(Q + q_rows + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Blocks past this request's new tokens (the grid fits the longest one) do no work.
    hi = tl.where(first < ext_len, tl.minimum(seq_len, prefix + last + 1), 0)
    if SLIDING:
        # from the block holding the first key the block's first query row can see
        lo = tl.maximum(prefix + first - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        lo = 0
    if SPLIT_MASK and not SLIDING:
        # Keys before the block's first query position are visible to every row of it.
        mid = tl.minimum((prefix + first) // BLOCK_N * BLOCK_N, hi)
        m_i, l_i, acc = attend_blocks(
            q, q_pos, K, V, Table + row * stride_table, lo, mid, kvh,
            sm_scale_log2, window, softcap_log2,
            stride_kt, stride_kh, stride_vt, stride_vh,
            BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, False, UPCAST, PRECISION,
            False, SOFTCAP,
        )  # fmt: skip
        m_i, l_i, acc = attend_more(
            m_i, l_i, acc, q, q_pos, K, V, Table + row * stride_table, mid, hi, kvh,
            sm_scale_log2, window, softcap_log2,
            stride_kt, stride_kh, stride_vt, stride_vh,
            BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, UPCAST, PRECISION,
            False, SOFTCAP,
        )  # fmt: skip
    else:
        m_i, l_i, acc = attend_blocks(
            q, q_pos, K, V, Table + row * stride_table, lo, hi, kvh,
            sm_scale_log2, window, softcap_log2,
            stride_kt, stride_kh, stride_vt, stride_vh,
            BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, UPCAST, PRECISION,
            SLIDING, SOFTCAP,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + o_rows + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    ext_lens: torch.Tensor,
    q_starts: torch.Tensor,
    max_ext_len: int,
    scale: float,
    block: int | None = None,
    page_size: int = 1,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    config: dict[str, int] | None = None,
    split_mask: bool | None = None,
    pack_gqa: bool = False,
) -> None:
    """q, out: [T, H, D] (all new tokens of the step); request r's new tokens are rows
    ``q_starts[r] : q_starts[r] + ext_lens[r]``; req_rows, seq_lens, ext_lens, q_starts: [R]
    int32 on the device; ``max_ext_len`` (a host int) sizes the grid. With ``page_size`` P > 1
    the table's positions [k * P, (k + 1) * P) must map to consecutive slots (one page).
    ``sliding_window`` W > 0: a token at position p sees keys p - W + 1 .. p only;
    ``logit_softcap`` c > 0: scores s -> c tanh(s / c). ``config``: GPU launch settings
    (default GPU_CONFIG); ``split_mask`` overrides its (and the CPU's) unmasked pass;
    ``pack_gqa``: a program per KV head whose blocks hold every query head of its group (each
    K/V block read once for the group, not once per head), the same arithmetic per row."""
    num_reqs = req_rows.shape[0]
    _, num_heads, head_dim = q.shape
    group = num_heads // k_buf.shape[1]
    on_cpu = q.device.type == "cpu"  # the Triton interpreter (CI)
    cfg = CPU_CONFIG if on_cpu else (config or GPU_CONFIG)
    block_m, block_n = (block, block) if block else (cfg["block_m"], cfg["block_n"])
    precise = on_cpu or q.dtype == torch.float32
    pack = pack_gqa and group > 1
    rows = max_ext_len * group if pack else max_ext_len
    grid = (num_reqs, num_heads // group if pack else num_heads, triton.cdiv(rows, block_m))
    _extend_kernel[grid](
        q, k_buf, v_buf, out, table, req_rows, seq_lens, ext_lens, q_starts,
        scale * LOG2E, sliding_window, logit_softcap * LOG2E,
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1),
        table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size,
        UPCAST=on_cpu, PRECISION="ieee" if precise else "tf32",
        SLIDING=sliding_window > 0, SOFTCAP=logit_softcap > 0,
        HEAVY_FIRST=bool(cfg["heavy_first"]),
        SPLIT_MASK=bool(cfg["split_mask"] if split_mask is None else split_mask), PACK_GQA=pack,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
