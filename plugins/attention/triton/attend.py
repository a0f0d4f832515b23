"""The pieces the decode and extend kernels share: paged KV-slot lookup and the online-softmax
loop over blocks of BLOCK_N keys.

Paging: with page size P the positions ``[k * P, (k + 1) * P)`` of a request live in one page,
in consecutive slots, so a block needs one table entry per page (or a single one when the block
lies inside one page) instead of one per position.

Per-layer options, each behind a constexpr switch so the plain kernels are unchanged: SLIDING
(query row i sees keys at positions > q_pos[i] - window) and SOFTCAP (scores s become
cap * tanh(s / cap) before the softmax; Gemma 2).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Kernels may only read globals declared constexpr (the interpreter does not check this).
_TWO_LOG2E = tl.constexpr(2.0 * LOG2E)


def launch_settings(base: dict[str, int], spec: str | None) -> dict[str, int]:
    """``base`` with the ``key=value,...`` settings of ``spec`` over it (integers; an unknown
    key is an error): how the backend reads its kernels' launch settings from the environment
    for A-B runs in the engine."""
    config = dict(base)
    for item in (spec or "").split(","):
        if item.strip():
            key, _, value = item.partition("=")
            if key.strip() not in config:
                raise ValueError(f"unknown launch setting {key!r} (known: {sorted(config)})")
            config[key.strip()] = int(value)
    return config


@triton.jit
def kv_slots(TableRow, n0, hi, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """KV slots of positions ``n0 + arange(BLOCK_N)`` of one req->token table row; positions
    at or past ``hi`` get a valid padding row. ``n0`` is a multiple of min(BLOCK_N, PAGE_SIZE)."""
    offs_n = tl.arange(0, BLOCK_N)
    if PAGE_SIZE == 1:
        slots = tl.load(TableRow + n0 + offs_n, mask=n0 + offs_n < hi, other=0)
    elif PAGE_SIZE >= BLOCK_N:
        # The block lies inside one page: one scalar load.
        first = tl.load(TableRow + n0 - n0 % PAGE_SIZE)
        slots = first + (n0 % PAGE_SIZE + offs_n)
    else:
        pages = n0 + tl.arange(0, BLOCK_N // PAGE_SIZE) * PAGE_SIZE
        first = tl.load(TableRow + pages, mask=pages < hi, other=0)
        slots = tl.reshape(first[:, None] + tl.arange(0, PAGE_SIZE)[None, :], [BLOCK_N])
    return slots.to(tl.int64)


@triton.jit
def softcap_scores(qk, softcap_log2):
    """cap * tanh(s / cap) of base-2 scores (``softcap_log2`` = cap * log2(e), so the result is
    the natural soft-capped score in base 2); tanh from exp2, which saturates to +-1."""
    e = tl.exp2(qk / softcap_log2 * _TWO_LOG2E)
    return softcap_log2 * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def attend_blocks(
    q, q_pos, K, V, TableRow, lo, hi, kvh,
    sm_scale_log2, window, softcap_log2,
    stride_kt, stride_kh, stride_vt, stride_vh,
    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SLIDING: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    """Attend the BLOCK_Q query rows ``q`` (scaled by ``sm_scale_log2`` in base 2) to keys
    ``[lo, hi)`` of KV head ``kvh``; with CAUSAL, row i sees keys at positions <= q_pos[i];
    with SLIDING, only keys at positions > q_pos[i] - window; with SOFTCAP, scores are capped.
    Returns the running max, the softmax denominator and the unnormalised output (float32)."""
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    return attend_more(
        m_i, l_i, acc, q, q_pos, K, V, TableRow, lo, hi, kvh,
        sm_scale_log2, window, softcap_log2,
        stride_kt, stride_kh, stride_vt, stride_vh,
        BLOCK_Q, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, CAUSAL, UPCAST, PRECISION,
        SLIDING, SOFTCAP,
    )  # fmt: skip


@triton.jit
def attend_more(
    m_i, l_i, acc, q, q_pos, K, V, TableRow, lo, hi, kvh,
    sm_scale_log2, window, softcap_log2,
    stride_kt, stride_kh, stride_vt, stride_vh,
    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SLIDING: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    """``attend_blocks`` continued from an online-softmax state (m_i, l_i, acc) over keys
    ``[lo, hi)``: so one query block can attend its unmasked keys and then, with CAUSAL, the
    few blocks that need the mask."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < hi
        slots = kv_slots(TableRow, n0, hi, PAGE_SIZE, BLOCK_N)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        k = k.to(q.dtype)  # float32 under UPCAST; an FP8 cache widened to the queries' dtype
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
        if SOFTCAP:
            qk = softcap_scores(qk, softcap_log2)
        if CAUSAL:
            # NOTE: a row is fully masked in a block only before its first key (never: key 0
            # is visible to every query), so m_new is finite after the first block.
            keep = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            keep = mask_n[None, :]
        if SLIDING:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if SLIDING:
            # A row may have seen no key yet (all before its window): shift by 0 there, not
            # by -inf (which would give nan); its max stays -inf.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc
