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

Checkpoints: ``core.weights.iter_weights`` passes FP8 tensors and ``*_scale`` tensors uncast;
``dequantizing`` (called by the decoder's ``load_weights``) pairs each FP8 weight with its scale,
gives the model the dequantized weight (so an FP8 checkpoint also loads on any platform without
``--quantization fp8``) and keeps the codes and scales in ``model.fp8_originals``, which
``quantize_model`` turns into ``Fp8Linear`` layers with the checkpoint's own codes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.config import ConfigError
from radixserve.plugins.models.parallel_layers import RowParallelLinear

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128
#: tensors of a checkpoint that carry scales: the weights' (paired with them), the
#: activations' static ones (unused: activations are scaled per step) and the KV cache's
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")


# ---- the checkpoint's scheme ----


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's ``quantization_config`` says about its FP8 weights."""

    #: "tensor", "channel" or "block" (the layout of the stored scales; also read from shapes)
    kind: str
    block: tuple[int, int] = (BLOCK, BLOCK)
    #: module names left in 16 bits (compressed-tensors' ``ignore``, HF's
    #: ``modules_to_not_convert``)
    ignore: tuple[str, ...] = field(default=())


def checkpoint_scheme(raw: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of a model's config.json (``raw``), or None for a checkpoint that is not
    FP8. Raises ConfigError for a quantized checkpoint in a form radixserve does not read."""
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
        if block:
            return Fp8Scheme("block", (int(block[0]), int(block[1])), ignore)
        return Fp8Scheme("tensor", ignore=ignore)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    return None


def _compressed_tensors_scheme(qc: dict[str, Any]) -> Fp8Scheme | None:
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if not weights:
        return None
    w = weights[0]
    if not (w.get("type") == "float" and int(w.get("num_bits", 0)) == 8):
        raise ConfigError(
            f"compressed-tensors checkpoint with {w.get('num_bits')}-bit {w.get('type')} "
            "weights: radixserve reads only its float-quantized 8-bit (FP8) form"
        )
    strategy = w.get("strategy", "tensor")
    ignore = tuple(qc.get("ignore") or ())
    if strategy == "block":
        b = w.get("block_structure") or [BLOCK, BLOCK]
        return Fp8Scheme("block", (int(b[0]), int(b[1])), ignore)
    if strategy not in ("tensor", "channel"):
        raise ConfigError(f"compressed-tensors FP8 strategy '{strategy}' is not supported")
    return Fp8Scheme(strategy, ignore=ignore)


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


# ---- loading and quantizing a model ----


@dataclass
class Fp8Originals:
    """An FP8 checkpoint's codes and scales, by the model parameter each went into:
    {parameter name: [(row offset, codes, scales)]}, and the KV cache's scales by checkpoint
    layer: {layer: [k_scale, v_scale]}."""

    scheme: Fp8Scheme
    pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    kv_scales: dict[int, list[float]] = field(default_factory=dict)


def dequantizing(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    target: Any,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` of an FP8 checkpoint with each FP8 weight dequantized to ``dtype`` (paired
    with its scale, which may come before or after it), the static activation scales dropped
    and the KV scales kept; the codes and scales go to ``model.fp8_originals``.
    ``target(name)``: the model's (parameter, expert, row offset) for a checkpoint name."""
    scheme = checkpoint_scheme(model.config.raw)
    assert scheme is not None
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:
        raise ConfigError(
            "an FP8 checkpoint with tensor parallelism is not supported yet (its scales are not "
            "sharded); run it with --tp-size 1, or a bf16 checkpoint with --quantization fp8"
        )
    originals = Fp8Originals(scheme)
    setattr(model, "fp8_originals", originals)  # noqa: B010 - read by quantize_model
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if name.endswith(KV_SCALE_SUFFIXES):
            _keep_kv_scale(originals, name, t)
            continue
        if name.endswith(".input_scale"):
            continue
        if name.endswith(SCALE_SUFFIXES):
            base = name.rsplit(".", 1)[0] + ".weight"
            scales[base] = t
        elif t.dtype == FP8:
            base = name
            codes[base] = t
        else:
            yield name, t.to(dtype)
            continue
        if base in codes and base in scales:
            q, s = codes.pop(base), scales.pop(base).float()
            yield base, dequantize(q, s, scheme.block).to(dtype)
            where = target(base)
            if where is not None and where[1] is None:  # (experts: quantized from the model)
                originals.pieces.setdefault(where[0], []).append((where[2] or 0, q, s))
    if codes:
        raise ValueError(f"FP8 weight '{next(iter(codes))}' has no weight_scale in the checkpoint")
    set_kv_scales(model, originals.kv_scales)


def _keep_kv_scale(originals: Fp8Originals, name: str, t: torch.Tensor) -> None:
    m = re.search(r"layers\.(\d+)\.", name)
    if m is None:
        return
    scales = originals.kv_scales.setdefault(int(m.group(1)), [1.0, 1.0])
    value = float(t.float().max())
    if name.endswith(".k_scale"):
        scales[0] = value
    elif name.endswith(".v_scale"):
        scales[1] = value
    else:  # kv_scale: one for both
        scales[:] = [value, value]


def set_kv_scales(model: nn.Module, kv_scales: dict[int, list[float]]) -> None:
    """Give the model's KV pool the checkpoint's scales (used by an FP8 cache,
    --kv-cache-dtype fp8_e4m3), by this pipeline stage's layer indices."""
    layers = getattr(model, "layers", None)
    first = getattr(model, "first_layer", 0)
    if not kv_scales or not layers:
        return
    pool = getattr(layers[0].attention, "kv_pool", None)
    if pool is None or not hasattr(pool, "set_scales"):
        return
    for layer, (k_scale, v_scale) in kv_scales.items():
        local = layer - first
        if 0 <= local < len(layers):
            pool.set_scales(layers[local].kv_layer, k_scale, v_scale)


def _from_pieces(
    linear: nn.Linear, pieces: list[tuple[int, torch.Tensor, torch.Tensor]], scheme: Fp8Scheme
) -> Fp8Linear | None:
    """The layer built from the checkpoint's own codes, or None where they do not make one
    (rows missing, or block scales whose pieces do not start on a block)."""
    pieces = sorted(pieces, key=lambda p: p[0])
    rows = 0
    for offset, q, _ in pieces:
        if offset != rows:
            return None
        rows += q.shape[0]
    if rows != linear.out_features:
        return None
    tp = linear.tp if isinstance(linear, RowParallelLinear) else None
    device = linear.weight.device
    q = torch.cat([p[1] for p in pieces]).to(device)
    blocked = [p[2].dim() == 2 and p[2].shape[-1] > 1 for p in pieces]
    if all(blocked):
        if any(p[1].shape[0] % scheme.block[0] for p in pieces[:-1]):
            return None  # a piece's rows end inside a block: its scales do not line up
        s = torch.cat([p[2] for p in pieces]).to(device)
        return Fp8Linear(q, s, linear.bias, scheme.block, tp)
    if any(blocked):
        return None
    s = torch.cat([p[2].float().reshape(-1).expand(p[1].shape[0]) for p in pieces]).to(device)
    return Fp8Linear(q, s, linear.bias, tp=tp)


def quantize_model(model: nn.Module) -> int:
    """Replace the linear layers of ``model.layers`` by ``Fp8Linear`` ones: from the
    checkpoint's own FP8 codes where the model was loaded from an FP8 checkpoint, else
    quantized from the loaded weights (a scale per output row). The LM head and the embedding
    stay in 16 bits, as in the FP8 releases. Returns the layers replaced."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ConfigError(
            f"model {type(model).__name__} does not support --quantization fp8 (it needs the "
            "decoder skeleton's layers)"
        )
    originals: Fp8Originals | None = getattr(model, "fp8_originals", None)
    names = {id(m): n for n, m in model.named_modules()}
    replaced = 0
    for layer in layers:
        for name, child in list(layer.named_modules()):
            if type(child) not in (nn.Linear, RowParallelLinear):
                continue
            parent_name, _, leaf = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            if hasattr(parent, "quantize_fp8"):  # a MoE block's router stays in 16 bits
                continue
            full = names[id(child)]
            new = None
            if originals is not None and f"{full}.weight" in originals.pieces:
                new = _from_pieces(child, originals.pieces[f"{full}.weight"], originals.scheme)
            if new is None:
                new = Fp8Linear.from_linear(child)
            setattr(parent, leaf, new)
            replaced += 1
        moe = getattr(layer, "moe", None)
        if moe is not None and hasattr(moe, "quantize_fp8"):
            moe.quantize_fp8()
    if originals is not None:
        originals.pieces.clear()  # the codes live in the layers now
    return replaced
