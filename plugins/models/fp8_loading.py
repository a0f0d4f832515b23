"""FP8 checkpoints and models (``--quantization fp8``): the scheme a checkpoint's
``quantization_config`` names, its FP8 codes and scales loaded, and a model's linear layers
turned into ``fp8.py``'s ``Fp8Linear``.

Checkpoints: ``core.weights.iter_weights`` passes FP8 tensors and ``*_scale`` tensors uncast;
``dequantizing`` (called by the decoder's ``load_weights``, weight_loading.py) pairs each FP8
weight with its scale, gives the model the dequantized weight (so an FP8 checkpoint also loads
on any platform without ``--quantization fp8``) and keeps the codes and scales in
``model.fp8_originals``, which ``quantize_model`` turns into ``Fp8Linear`` layers with the
checkpoint's own codes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from radixserve.core.config import ConfigError
from radixserve.plugins.models.fp8 import BLOCK, FP8, Fp8Linear, dequantize
from radixserve.plugins.models.parallel_layers import RowParallelLinear

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
