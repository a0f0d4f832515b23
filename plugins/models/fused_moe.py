"""Fused Mixture-of-Experts for CUDA/ROCm devices: two grouped GEMMs over tokens sorted by expert.

``fused_experts(x, w13, w2, weights, ids)`` computes what ``moe.SparseMoE``'s reference loop
computes (``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``, each expert a SiLU-gated MLP):

1. ``align``: the T * k (token, slot) pairs are grouped by expert (in token order) and each
   expert's run is padded to a multiple of ``BLOCK_M`` rows (the padding holds T * k, an id no
   pair has), so every ``BLOCK_M``-row block of the list belongs to one expert. Torch ops with
   fixed output shapes (no host sync): the whole path can be captured in a CUDA graph.
2. ``_expert_gemm_kernel`` (GATED): for each block, x's rows times the expert's gate and up
   rows, both accumulated in float32 by one program, then ``SiLU(gate) * up`` -> [T * k, I].
3. ``_expert_gemm_kernel``: those rows times the expert's down projection, times the pair's
   router weight -> [T * k, H]; the k slots of a token are then summed.

Blocks past the padded total (the grid is sized for the worst case) return at once. Products
accumulate in float32 and are rounded to x's dtype once per GEMM (the reference rounds after each
op), so in bfloat16 the fused path is at least as close to the float32 result as the reference.

Decode-sized steps (``Tiles.pair_blocks``): each (token, slot) pair is a block of its own, so
``align`` is three small ops instead of a dozen (the one-hot count, cumsums and search cost more
launches than the GEMMs' time at batch 1); an expert two pairs share is then read twice, which
costs nothing at batch 1 (a token's k experts differ). The tiles per shape come from
``fused_moe_configs.json`` (per device, expert shape and batch size: written by
``bench/experiments/gpu_kernels.py --tune-moe``), else from ``default_tiles``.

FP8 experts (``--quantization fp8``): ``w13``/``w2`` hold float8_e4m3fn codes with a float32
scale per output row ([E, 2I] and [E, H]); the kernels widen the codes to the activations' dtype
and scale each output column of the float32 sums (weight-only: activations stay 16-bit, the
weight bytes a decode step reads are halved).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixserve.plugins.models import tuned_tiles


class Aligned(NamedTuple):
    """The (token, slot) pairs sorted by expert, in blocks of ``block_m`` rows of one expert."""

    sorted_ids: torch.Tensor  # [max_blocks * block_m] flat pair ids (t * k + slot); T * k pads
    expert_ids: torch.Tensor  # [max_blocks] the expert of each block
    num_padded: torch.Tensor  # [1] rows used (the sum over experts of their padded runs)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks ``align`` fills: each expert that has pairs wastes less
    than one block on padding."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """Sort the pairs of ``ids`` [T, k] by expert, each expert's run padded to ``block_m``."""
    flat = ids.flatten().to(torch.int64)
    n, device = flat.numel(), flat.device
    # NOTE: no sort and no bincount (either may sync with the host or resist CUDA-graph
    # capture): a pair's rank among its expert's pairs is a running count over a one-hot
    # [pairs, experts] matrix, a few MB even for a prefill chunk.
    onehot = flat[:, None] == torch.arange(num_experts, device=device)
    counts = onehot.sum(0)
    rank = onehot.cumsum(0, dtype=torch.int32).gather(1, flat[:, None]).squeeze(1) - 1
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    blocks = max_blocks(n, num_experts, block_m)
    sorted_ids = torch.full((blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[(ends - padded)[flat] + rank] = torch.arange(n, dtype=torch.int32, device=device)
    starts = torch.arange(blocks, device=device) * block_m
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return Aligned(sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32))


def align_pairs(ids: torch.Tensor, block_m: int) -> Aligned:
    """One block per (token, slot) pair, in pair order, the rest of each block padding: for
    decode-sized steps, where ``align``'s counting costs more than it saves."""
    flat = ids.flatten()
    n, device = flat.numel(), flat.device
    sorted_ids = torch.full((n, block_m), n, dtype=torch.int32, device=device)
    sorted_ids[:, 0] = torch.arange(n, dtype=torch.int32, device=device)
    used = torch.full((1,), n * block_m, dtype=torch.int32, device=device)
    return Aligned(sorted_ids.view(-1), flat.to(torch.int32), used)


@triton.jit
def _expert_gemm_kernel(
    X, W, Out, SortedIds, ExpertIds, NumPadded, RouteWeights, WScale,
    num_pairs, N, K,
    stride_xt, stride_we, stride_wn, stride_ot, stride_se,
    TOP_K: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, W_FP8: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_N tile of Out for the pairs of one block (row r of X: pair // TOP_K).
    GATED: Out[pair, n] = SiLU(x . W[e, n]) * (x . W[e, N + n]), W: [E, 2N, K]; else
    Out[pair, n] = route[pair] * (x . W[e, n]), W: [E, N, K]. W_FP8: W holds FP8 codes and
    WScale [E, rows of W] their scales (w = code * scale[e, row])."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedIds + offs_m).to(tl.int64)
    row_ok = pairs < num_pairs
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + (pairs // TOP_K)[:, None] * stride_xt + offs_k[None, :]
    w_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
        w = w.to(a.dtype)  # FP8 codes widened (a no-op for 16-bit weights)
        acc += tl.dot(a, w, input_precision=PRECISION)
        if GATED:  # the up rows sit N rows below the gate rows
            w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            up += tl.dot(a, w_up.to(a.dtype), input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_FP8:  # a scale per weight row: per output column of the sums
        s_ptrs = WScale + expert * stride_se + offs_n
        acc *= tl.load(s_ptrs, mask=col_ok, other=0.0)[None, :]
        if GATED:
            up *= tl.load(s_ptrs + N, mask=col_ok, other=0.0)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * up
    else:
        acc = acc * tl.load(RouteWeights + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = Out + pairs[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    #: one block per (token, slot) pair (``align_pairs``) instead of blocks per expert
    pair_blocks: bool = False


#: the tuned tiles: {device name: {"E,I,H": {"tokens": {Tiles' fields}}}}
CONFIGS = Path(__file__).with_name("fused_moe_configs.json")


def default_tiles(num_tokens: int, num_pairs: int, num_experts: int) -> Tiles:
    """Untuned tiles: one token's pairs in blocks of their own; decode steps (few pairs per
    expert) waste least in 16-row blocks; prefills fill larger ones."""
    if num_tokens == 1:
        return Tiles(16, 64, 128, 4, 3, pair_blocks=True)
    if num_pairs <= 2 * num_experts:
        return Tiles(16, 64, 128, 4, 3)
    return Tiles(64, 128, 64, 8, 3)


def tiles(
    num_tokens: int, num_pairs: int, num_experts: int, inter: int = 0, hidden: int = 0,
    device_name: str | None = None,
) -> Tiles:  # fmt: skip
    """The table's tiles for this device and expert shape at the nearest tuned token count
    (the smallest at or above ``num_tokens``, else the largest), else ``default_tiles``."""
    shape = f"{num_experts},{inter},{hidden}"
    table = tuned_tiles.entries(CONFIGS, device_name, shape) if device_name else {}
    if not table:
        return default_tiles(num_tokens, num_pairs, num_experts)
    return Tiles(**tuned_tiles.nearest(table, num_tokens))


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tile: Tiles | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], router ``weights`` and
    expert ``ids`` [T, k] -> [T, H]: the SiLU-gated experts' outputs, weighted and summed.
    ``scales``: FP8 experts' (w13 scales [E, 2I], w2 scales [E, H])."""
    t, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, ids.shape[1]
    out = torch.empty((t, top_k, hidden), dtype=x.dtype, device=x.device)
    if t == 0:
        return out.sum(1)
    n = t * top_k
    tile = tile or tiles(t, n, num_experts, inter, hidden, tuned_tiles.device_name(x.device))
    if tile.pair_blocks:
        a = align_pairs(ids, tile.block_m)
    else:
        a = align(ids, num_experts, tile.block_m)
    blocks = a.expert_ids.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    # float32 models multiply in full float32 (Triton's default for it would be TF32); the
    # interpreter (a CPU device) multiplies bfloat16 wrongly, so there the tiles go float32 first
    on_cpu = x.device.type == "cpu"
    precise = x.dtype == torch.float32 or on_cpu
    common = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                  PRECISION="ieee" if precise else "tf32", UPCAST=on_cpu,
                  W_FP8=scales is not None,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)  # fmt: skip
    route = weights.float().contiguous().flatten()
    s13, s2 = scales if scales is not None else (route, route)  # (unread without FP8)
    _expert_gemm_kernel[(blocks * triton.cdiv(inter, tile.block_n),)](
        x, w13, act, a.sorted_ids, a.expert_ids, a.num_padded, route, s13,
        n, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), s13.stride(0),
        TOP_K=top_k, GATED=True, **common,
    )  # fmt: skip
    flat_out = out.view(n, hidden)
    _expert_gemm_kernel[(blocks * triton.cdiv(hidden, tile.block_n),)](
        act, w2, flat_out, a.sorted_ids, a.expert_ids, a.num_padded, route, s2,
        n, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), flat_out.stride(0), s2.stride(0),
        TOP_K=1, GATED=False, **common,
    )  # fmt: skip
    return out.sum(1)
