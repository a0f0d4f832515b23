"""Float32 linear layers on a packed copy of their weights (CPU).

Two packings, the first that applies:

- **panels** (``PanelPacking``): radixserve's AVX2 kernel (``cpu_kernels/f32_linear.cpp``) over
  weights in panels of 16 output features, for every row count. On the 2-core AVX2 EPYC VM,
  SmolLM2's 120 decoder linears took 13.4 ms at one row (MKL's matrix-vector product: 29.8),
  47 ms at 32 rows (oneDNN's packed GEMM: 60) and 1.20 s at 1,024 (MKL: 1.25). Needs the C++
  kernels built with AVX2 and FMA.
- **oneDNN** (``OneDNNPacking``): ``torch.ops.mkldnn._reorder_linear_weight``'s blocked layout,
  what inductor uses for its frozen CPU linears, for steps of 2 to 255 rows; one-row steps and
  prefill chunks keep MKL's ``F.linear``, the faster one there.

Each layer holds its weights twice (the float parameter, kept for the state dict, the tied
embedding and reloads, and the packed copy). The copy is rebuilt when the weights are reloaded
(``weights_reloaded``). Not used with tensor parallelism (a row-parallel layer all-reduces in its
own forward) or with ``--enable-torch-compile`` (inductor compiles the linears itself).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.config import EngineConfig
from radixserve.plugins.hardware import cpu_kernels
from radixserve.plugins.models.parallel_layers import RowParallelLinear

#: oneDNN: rows its blocked layout is tuned for (a decode batch; it serves every count)
PACK_ROWS = 8
#: oneDNN: steps of fewer rows multiply by the float parameter (MKL's matrix-vector product)
PACKED_MIN_ROWS = 2
#: oneDNN: steps of this many rows or more (prefill chunks) go back to MKL's GEMM, the faster
#: one there: SmolLM2's 120 linears, 2 AVX2 cores, 174-183 GFLOP/s against oneDNN's packed
#: 168-172 at 512-1,024 rows, 168 against 160 at 256; packed stays ahead at 128 (154 vs 149)
PACKED_MAX_ROWS = 256
#: panels: output features a panel holds (the kernel's kPanel)
PANEL = 16


class PanelPacking:
    """radixserve's AVX2 kernel over [panels, in_features, 16] copies, at every row count."""

    name = "radixserve AVX2 panels"
    #: each output is one FMA chain over K in order, whatever the rows and threads
    #: (f32_linear.cpp): --enable-deterministic-inference keeps these linears
    batch_invariant = True

    def __init__(self) -> None:
        self._op = cpu_kernels.load().linear_f32_packed.default

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        panels = -(-out_features // PANEL)
        padded = F.pad(weight.detach(), (0, 0, 0, panels * PANEL - out_features))
        # torch's CPU allocator aligns storage to 64 bytes, as the kernel's loads need
        return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()

    @staticmethod
    def takes(rows: int) -> bool:
        return True

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return self._op(x, packed, out_features, bias)


class OneDNNPacking:
    """oneDNN's blocked layout, for steps of PACKED_MIN_ROWS to PACKED_MAX_ROWS - 1 rows."""

    name = "oneDNN"

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)

    @staticmethod
    def takes(rows: int) -> bool:
        return PACKED_MIN_ROWS <= rows < PACKED_MAX_ROWS

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


Packing = PanelPacking | OneDNNPacking


@cache
def default_packing() -> Packing | None:
    """The packing this machine runs: panels where the kernels build with AVX2, else oneDNN
    where torch has it, else None."""
    if cpu_kernels.unavailable_reason() is None and cpu_kernels.load().linear_f32_vectorized():
        return PanelPacking()
    if torch.backends.mkldnn.is_available():
        return OneDNNPacking()
    return None


def _packed_linear(
    x: torch.Tensor, packing: Packing, packed: torch.Tensor, out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    out = packing(x.reshape(-1, x.shape[-1]), packed, out_features, bias)
    return out.view(*x.shape[:-1], out_features)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (its class swapped in place: same parameters, same state dict) that
    multiplies the steps its packing takes by a packed copy of its weight."""

    packed: torch.Tensor
    packing: Packing

    def weights_reloaded(self) -> None:
        if not hasattr(self, "packing"):
            packing = default_packing()
            assert packing is not None, "no packing on this machine (packed_linears_unavailable)"
            self.packing = packing
        self.packed = self.packing.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packing.takes(x.numel() // self.in_features):
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, self.packing, self.packed, self.out_features, self.bias)


class PackedHead(nn.Module):
    """The LM head (``model.head``) over a packed copy of ``weight`` (the tied embedding's or
    lm_head's, which stays for the embedding lookup and the steps the packing leaves)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        packing = default_packing()
        assert packing is not None, "no packing on this machine (packed_linears_unavailable)"
        self.packing = packing
        self.packed = packing.pack(weight)

    def weights_reloaded(self) -> None:
        self.packed = self.packing.pack(self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.packing.takes(h.numel() // self.weight.shape[1]):
            return F.linear(h, self.weight)
        return _packed_linear(h, self.packing, self.packed, self.weight.shape[0], None)


def packed_linears_unavailable(model: nn.Module, config: EngineConfig) -> str | None:
    """Why the model's linears stay on MKL here, or None when they can be packed."""
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
    if default_packing() is None:
        return "neither radixserve's AVX2 kernels nor oneDNN run here"
    if config.enable_deterministic_inference and not is_batch_invariant(default_packing()):
        return "deterministic inference: oneDNN tiles by row count (fixed row blocks instead)"
    return None


def is_batch_invariant(module: object) -> bool:
    """Whether ``module`` (a packing, a packed layer or head) gives a row the same result in
    any batch (--enable-deterministic-inference keeps it; invariant_ops.py)."""
    packing = getattr(module, "packing", module)
    return bool(getattr(packing, "batch_invariant", False))


def pack_module_linears(module: nn.Module) -> int:
    """Swap ``module``'s float32 ``nn.Linear`` (and unsplit row-parallel) layers for packed
    ones, in place. Returns the layers packed."""
    packed = 0
    for child in module.modules():
        if type(child) in (nn.Linear, RowParallelLinear) and child.weight.dtype == torch.float32:
            child.__class__ = PackedLinear
            child.weights_reloaded()  # type: ignore[attr-defined]
            packed += 1
    return packed


def pack_linears(model: nn.Module) -> int:
    """Give the decoder layers' linears and the LM head packed copies of their weights.
    Returns the layers packed."""
    packed = sum(pack_module_linears(layer) for layer in model.layers)  # type: ignore[union-attr]
    if not getattr(model, "computes_logits", True):  # a pipeline stage before the last
        return packed
    lm_head = getattr(model, "lm_head", None)
    weight = lm_head.weight if lm_head is not None else model.embed_tokens.weight
    model.head = PackedHead(weight.data)
    return packed
