"""Float linear layers on oneDNN's packed weights, for steps of several rows (CPU): decode
batches, not prefill chunks (``PACKED_MAX_ROWS``).

torch's CPU ``F.linear`` runs on MKL, whose float32 GEMM over a few rows reads the weights far
below the memory's speed on the AMD EPYC VM (7 MB of weights out of cache: 1.0 ms at 4 and 8
rows, where oneDNN multiplies by the same weights packed in its blocked layout in 0.43-0.49
ms; a SmolLM2 decode step at batch 8 took 150-213 ms on MKL against 100 on oneDNN, in one
process). At one row MKL's matrix-vector product was the faster one in the engine (68 against
88 ms a step), so a single-row step keeps it: each layer holds its weights twice (the float
parameter and the packed copy), which on the CPU's memory is the price of the speed.

The packed copy is what ``torch.ops.mkldnn._reorder_linear_weight`` makes for inductor's own
frozen CPU linears; it is rebuilt when the weights are reloaded (``weights_reloaded``). Not
used with tensor parallelism (a row-parallel layer all-reduces in its own forward), with
``--enable-torch-compile`` (inductor compiles the linears itself), or where torch has no oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.config import EngineConfig
from radixserve.plugins.models.parallel_layers import RowParallelLinear

#: rows the packed layout is tuned for (a decode batch; it serves every count, best near it)
PACK_ROWS = 8
#: steps of fewer rows multiply by the float parameter (MKL's matrix-vector product)
PACKED_MIN_ROWS = 2
#: steps of this many rows or more (prefill chunks) go back to MKL's GEMM, which is the faster
#: one there: SmolLM2's 120 linears, 2 AVX2 cores, 174-183 GFLOP/s against oneDNN's packed
#: 168-172 at 512-1,024 rows, 168 against 160 at 256; packed stays ahead at 128 (154 vs 149)
PACKED_MAX_ROWS = 256


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _packed_rows(rows: int) -> bool:
    """Whether a step of ``rows`` rows multiplies by the packed copy."""
    return PACKED_MIN_ROWS <= rows < PACKED_MAX_ROWS


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (its class swapped in place: same parameters, same state dict) that
    multiplies steps of PACKED_MIN_ROWS rows or more by a packed copy of its weight."""

    packed: torch.Tensor

    def weights_reloaded(self) -> None:
        self.packed = _pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _packed_rows(x.numel() // self.in_features):
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, self.packed, self.bias)


class PackedHead(nn.Module):
    """The LM head (``model.head``) over a packed copy of ``weight`` (the tied embedding's or
    lm_head's, which stays for the embedding lookup and single-row steps)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.packed = _pack(weight)

    def weights_reloaded(self) -> None:
        self.packed = _pack(self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not _packed_rows(h.numel() // self.weight.shape[1]):
            return F.linear(h, self.weight)
        return _packed_linear(h, self.packed, None)


def packed_linears_unavailable(model: nn.Module, config: EngineConfig) -> str | None:
    """Why the model's linears stay on MKL here, or None when they can be packed."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if config.enable_torch_compile:
        return "--enable-torch-compile compiles the linears itself"
    if config.quantization is not None:
        return "the linears are quantized"
    if config.tp_size != 1:
        return "tensor parallelism all-reduces inside the row-parallel layers"
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "head") or model.head is not None:
        return f"model {type(model).__name__} has no decoder skeleton with a free LM head"
    if next(model.parameters()).dtype != torch.float32:
        return "only float32 weights are packed"
    return None


def pack_linears(model: nn.Module) -> int:
    """Give the decoder layers' linears and the LM head packed copies of their weights.
    Returns the layers packed."""
    packed = 0
    for layer in model.layers:  # type: ignore[union-attr]
        for child in layer.modules():
            if type(child) in (nn.Linear, RowParallelLinear):
                child.__class__ = PackedLinear
                child.weights_reloaded()  # type: ignore[attr-defined]
                packed += 1
    lm_head = getattr(model, "lm_head", None)
    weight = lm_head.weight if lm_head is not None else model.embed_tokens.weight
    model.head = PackedHead(weight.data)
    return packed
