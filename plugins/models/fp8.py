"""FP8 (e4m3) weights (``--quantization fp8``, CUDA): checkpoints stored in FP8 and bf16 ones
quantized on load.

Weights are ``float8_e4m3fn`` codes ``q`` with float32 scales, ``w = q * s``, in one of three
layouts (``Fp8Linear.kind``):

``tensor``   one scale for the matrix (HF ``quant_method: fp8`` per-tensor, compressed-tensors'
             ``strategy: tensor``); kept as a scale per output row, which is what a fused
             projection (q|k|v, gate|up) of several such matrices needs anyway;
``channel``  one scale per output row (compressed-tensors' ``strategy: channel``, and what a
             bf16 checkpoint is quantized to on load);
``block``    one scale per 128 x 128 tile (``weight_block_size`` [128, 128] as in the DeepSeek-V3
             and Qwen3 FP8 releases; the tensor is named ``weight_scale_inv`` there but is a
             multiplier like the others).

Activations are quantized per step (dynamic): one scale per token for ``tensor``/``channel``
weights, one per token and 128 input features for ``block`` ones. The products:

- per-row scales on CUDA: ``torch._scaled_mm`` (cuBLASLt's FP8 GEMM on the tensor cores) with
  row-wise scales on both sides, bfloat16 out; a one-row step (batch-1 decode) instead reads
  the codes with ``fp8_gemv``, a Triton matrix-vector product that widens them and leaves the
  activations unrounded (RADIXSERVE_FP8_GEMV=0: the GEMM there too);
- block scales: ``block_fp8_matmul`` below, a Triton kernel that multiplies 128-wide slices of
  FP8 codes on the tensor cores and applies both operands' scales to each slice's partial sum;
- anywhere else (the CPU, which refuses ``--quantization fp8``, and tests): ``reference_matmul``,
  the same rounding of both operands in plain float32 arithmetic.

Checkpoints (their scheme, their codes and scales loaded) and a whole model's layers
quantized: ``fp8_loading.py``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.plugins.models.parallel_layers import RowParallelLinear

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128


# ---- rounding ----


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, in] float -> (FP8 codes, float32 scales [rows]): one symmetric scale per row
    (per output channel of a weight, per token of an activation)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_groups(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, in] -> (FP8 codes, float32 scales [rows, ceil(in / group)]): one scale per row and
    ``group`` input features (the activations of a block-scaled product)."""
    rows, k = x.shape
    pad = -k % group
    xf = F.pad(x.float(), (0, pad)).view(rows, -1, group)
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, -1)[:, :k]
    return q.contiguous(), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[
    torch.Tensor, torch.Tensor
]:  # fmt: skip
    """[out, in] float -> (FP8 codes, float32 scales [ceil(out / b0), ceil(in / b1)])."""
    out_f, in_f = w.shape
    b0, b1 = block
    wf = F.pad(w.float(), (0, -in_f % b1, 0, -out_f % b0))
    tiles = wf.view(wf.shape[0] // b0, b0, wf.shape[1] // b1, b1)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(wf.shape)[:out_f, :in_f].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> (
    torch.Tensor
):  # fmt: skip
    """The float32 [out, in] weights FP8 codes and their scales stand for: ``scale`` a scalar,
    one per row ([out] or [out, 1]) or one per tile ([ceil(out / b0), ceil(in / b1)])."""
    out_f, in_f = q.shape
    s = scale.float()
    if s.numel() == 1:
        return q.float() * s.reshape(())
    if s.numel() == out_f and (s.dim() == 1 or s.shape[-1] == 1):
        return q.float() * s.reshape(out_f, 1)
    b0, b1 = block
    if s.dim() != 2 or s.shape != (-(-out_f // b0), -(-in_f // b1)):
        raise ValueError(
            f"FP8 weight of shape {tuple(q.shape)} with scales of shape {tuple(s.shape)}: "
            f"neither per-tensor, per-channel nor {b0}x{b1} blocks (with tensor parallelism, "
            "FP8 checkpoints are not sharded yet)"
        )
    full = s.repeat_interleave(b0, dim=0)[:out_f].repeat_interleave(b1, dim=1)[:, :in_f]
    return q.float() * full


# ---- the products ----


def reference_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """x [rows, in] @ w.T in float32, with x rounded as the kernels round it (per token, or per
    token and ``block[1]`` inputs for block-scaled weights) and w = dequantize(q, scale)."""
    if block is None:
        xq, xs = quantize_rows(x)
        xd = xq.float() * xs[:, None]
        return xd @ dequantize(q, scale).t()
    xq, xs = quantize_groups(x, block[1])
    xd = xq.float() * xs.repeat_interleave(block[1], dim=1)[:, : x.shape[1]]
    return xd @ dequantize(q, scale, block).t()


def quantize_activations(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` (``group`` None: scales [rows]) or ``quantize_groups`` (scales
    [rows, ceil(in / group)]) in one Triton launch where Triton runs (the torch ops are five
    launches, which a batch-1 decode step would pay on every projection)."""
    if not use_triton(x.device):
        return quantize_rows(x) if group is None else quantize_groups(x, group)
    from radixserve.plugins.models import fp8_kernels

    rows, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    size = k if group is None else group
    groups = -(-k // size)
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    s = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows:
        fp8_kernels.quantize_groups_kernel[(rows, groups)](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
            GROUP=size, BLOCK=min(1024, 1 << (size - 1).bit_length()),
            EXACT=x.device.type == "cpu",
        )  # fmt: skip
    return q, (s.view(rows) if group is None else s)


def scaled_mm(x: torch.Tensor, q: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (bf16) @ (q * row_scale[:, None]).T on the tensor cores: activations rounded
    per token, cuBLASLt's FP8 GEMM with row-wise scales on both sides, bfloat16 out."""
    xq, xs = quantize_activations(x, None)
    return torch._scaled_mm(
        xq, q.t(), scale_a=xs[:, None], scale_b=row_scale[None, :], out_dtype=torch.bfloat16
    )


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels run here: compiled on a GPU, or interpreted on the CPU under
    TRITON_INTERPRET=1 (the tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


class Fp8Linear(nn.Module):
    """A linear layer over FP8 weights (codes ``qweight`` [out, in] and float32 ``scale``: [out]
    for tensor/channel layouts, [ceil(out / 128), ceil(in / 128)] for block ones). Activations
    are quantized per step; the output is in the input's dtype. Row-parallel layers (tensor
    parallelism) all-reduce their partial outputs as before."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        block: tuple[int, int] | None = None,
        tp: Any = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.block = block
        self.register_buffer("qweight", qweight.to(FP8).contiguous())
        scale = scale.float()
        if block is None:  # a scalar or a scale per row: one per row
            scale = scale.reshape(-1).expand(self.out_features).contiguous()
        self.register_buffer("scale", scale.contiguous())
        self.bias = bias
        self.tp = tp
        #: cuBLASLt's FP8 GEMM takes widths in sixteens (others take the reference product)
        self.fits_scaled_mm = self.in_features % 16 == 0 and self.out_features % 16 == 0
        #: the one-row kernel's tiles (None: one-row steps take the general product); per-row
        #: scales only, and off with RADIXSERVE_FP8_GEMV=0
        self.gemv_tiles = None
        if block is None and os.environ.get("RADIXSERVE_FP8_GEMV", "1") != "0":
            self.gemv_tiles = gemv_tiles(self.out_features, self.in_features)

    @property
    def kind(self) -> str:
        return "channel" if self.block is None else "block"

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """A bf16 layer quantized on load: one scale per output row."""
        q, s = quantize_rows(linear.weight.data)
        tp = linear.tp if isinstance(linear, RowParallelLinear) else None
        return cls(q, s, linear.bias, tp=tp)

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scale, self.block or (BLOCK, BLOCK))

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        dev = rows.device
        if rows.shape[0] == 1 and self.gemv_tiles is not None and use_triton(dev):
            return fp8_gemv(rows, self.qweight, self.scale, self.gemv_tiles)
        if self.block is not None and use_triton(dev):
            return block_fp8_matmul(rows, self.qweight, self.scale, self.block, rows.dtype)
        if self.block is None and dev.type == "cuda" and self.fits_scaled_mm:
            return scaled_mm(rows.to(torch.bfloat16), self.qweight, self.scale).to(rows.dtype)
        return reference_matmul(rows, self.qweight, self.scale, self.block).to(rows.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.matmul(x.reshape(-1, self.in_features))
        out = out.view(*shape[:-1], self.out_features)
        if self.tp is not None and self.tp.size > 1:
            out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


def gemv_tiles(n: int, k: int) -> tuple[int, int, int] | None:
    """(BLOCK_N, BLOCK_K, warps) of ``fp8_gemv`` for an [n, k] weight, or None where no strip
    divides it: plugins/hardware/gemv.py's choice (4 rows a program, 16 for tall matrices) in
    strips twice as wide (the same bytes a load). Not tuned on a GPU yet."""
    rows = 16 if n >= 8192 else 4
    if n % rows:
        return None
    for bk in (2048, 1024, 512, 256, 128):
        if k % bk == 0 and (rows == 4 or bk <= 512):
            return rows, bk, 4
    return None


def fp8_gemv(
    x: torch.Tensor, q: torch.Tensor, row_scale: torch.Tensor, tiles: tuple[int, int, int]
) -> torch.Tensor:
    """x [1, K] @ (q * row_scale[:, None]).T -> [1, N] in x's dtype: a batch-1 decode step's
    product reads the FP8 codes once, with x unrounded (weight-only at one row)."""
    from radixserve.plugins.models import fp8_kernels

    n, k = q.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    bn, bk, warps = tiles
    fp8_kernels.fp8_gemv_kernel[(n // bn,)](
        x, q, row_scale, y, n, k, q.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps
    )
    return y


# ---- the block-scaled Triton kernel ----


def block_fp8_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    tiles: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] @ (q * block scales).T with x rounded per token and ``block[1]`` inputs: FP8 x
    FP8 products on the tensor cores, float32 accumulation, each K slice's partial sum scaled by
    its activation and weight scales. ``tiles``: (BLOCK_M, BLOCK_N), else chosen from M."""
    from radixserve.plugins.models import fp8_kernels

    xq, xs = quantize_activations(x, block[1])
    m, k = xq.shape
    n = q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    bm, bn = tiles or fp8_kernels.tiles_for(m)
    grid = (-(-m // bm), -(-n // bn))
    fp8_kernels.block_fp8_gemm[grid](
        xq, q, out, xs, scale, m, n, k,
        xq.stride(0), q.stride(0), out.stride(0), xs.stride(0), scale.stride(0),
        GROUP_N=block[0], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block[1],
    )  # fmt: skip
    return out
