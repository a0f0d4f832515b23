"""Batch-invariant linears for --enable-deterministic-inference (core/deterministic.py).

A GEMM library picks its kernel, tiling and split of the reduction by the shape it is given,
so one row's result can change with the number of rows beside it (MKL's matrix-vector product
at one row against oneDNN's GEMM at 8, cuBLAS's split-K at small batches). Here every product
runs on blocks of exactly ``row_block`` rows (the last block zero-padded): each call has the
same shape whatever the step holds, so a row's result depends only on the row. Rows of a
block never mix (a GEMM reduces along the features only) and every row of a block goes through
the same inner kernel (``tests/plugins/test_deterministic.py`` checks both on this machine).

Cost: a step of n rows pays ceil(n / row_block) calls of row_block rows; a one-row decode pays
a ``row_block``-row product (measured in docs/benchmarks.md's deterministic section).

Opt-in on CUDA: with ``RADIXSERVE_INVARIANT_GEMM=triton`` the layers swapped here run CUDA
tensors through invariant_gemm.py's Triton kernel instead (one launch per product, tiles chosen
without M, so no row blocks to pay for); the CPU keeps the row blocks (except under
TRITON_INTERPRET=1, the tests' way to run the kernel on a CPU machine).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

#: rows per product on the CPU and on GPUs. On an H100 at the 8B shape a GPU's product costs
#: about the same at 1 and 128 rows; 128 against 64 halves a prefill's weight reads for the same
#: batch-1 speed (1.25x against 1.21x slower than the mode off; 256 rows: 1.42x).
CPU_ROW_BLOCK = 8
GPU_ROW_BLOCK = 128

GEMM_ENV = "RADIXSERVE_INVARIANT_GEMM"

#: invariant_gemm.invariant_linear's signature: (x, weight, bias) -> x @ weight.T + bias
Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def row_block_for(device: torch.device | str) -> int:
    """Rows per product on ``device``; RADIXSERVE_INVARIANT_ROW_BLOCK overrides it (for A/B
    runs: a larger block re-reads the weights fewer times in a prefill and costs a small
    batch more arithmetic)."""
    chosen = os.environ.get("RADIXSERVE_INVARIANT_ROW_BLOCK")
    if chosen:
        return int(chosen)
    return CPU_ROW_BLOCK if torch.device(device).type == "cpu" else GPU_ROW_BLOCK


def chosen_gemm() -> Gemm | None:
    """The Triton kernel when RADIXSERVE_INVARIANT_GEMM=triton, None for the row blocks (unset
    or ``blocks``); read when the layers are swapped, not per step."""
    choice = os.environ.get(GEMM_ENV, "blocks")
    if choice == "blocks":
        return None
    if choice != "triton":
        raise ValueError(f"{GEMM_ENV}={choice!r}: expected 'blocks' (the default) or 'triton'")
    try:
        from radixserve.plugins.models import invariant_gemm
    except ImportError as exc:
        raise ImportError(f"{GEMM_ENV}=triton needs the 'triton' package: {exc}") from exc
    return invariant_gemm.invariant_linear


def fixed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row_block: int,
    gemm: Gemm | None,
) -> torch.Tensor:
    """``F.linear`` through ``gemm`` where Triton runs (CUDA tensors; the CPU under
    TRITON_INTERPRET=1), else in row blocks."""
    if gemm is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return gemm(x, weight, bias)
    return block_linear(x, weight, bias, row_block)


def block_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_block: int
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed ``row_block`` rows at a time (x: [..., in])."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    n = x2.shape[0]
    pad = -n % row_block
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    parts = [F.linear(x2[i : i + row_block], weight, bias) for i in range(0, n + pad, row_block)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:n].view(*lead, weight.shape[0])


class BlockLinear(nn.Linear):
    """An ``nn.Linear`` (its class swapped in place: same parameters and state dict) whose
    product runs in fixed row blocks (or through ``gemm``: ``fixed_linear``)."""

    row_block: int
    gemm: Gemm | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fixed_linear(x, self.weight, self.bias, self.row_block, self.gemm)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's share before its all-reduce (one rank: the product)."""
        return fixed_linear(x, self.weight, None, self.row_block, self.gemm)


class BlockHead(nn.Module):
    """The LM head (``model.head``) over ``weight`` in fixed row blocks (or through the
    kernel ``chosen_gemm`` names)."""

    def __init__(self, weight: torch.Tensor, row_block: int) -> None:
        super().__init__()
        self.weight = weight
        self.row_block = row_block
        self.gemm = chosen_gemm()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return fixed_linear(h, self.weight, None, self.row_block, self.gemm)


def keeps_rows_apart(module: nn.Module) -> bool:
    """Whether ``module``'s kernel is batch-invariant already: it (or its ``packing``)
    declares ``batch_invariant`` (the CPU's AVX2 panel linears, plugins/hardware/cpu_linear.py)."""
    packing = getattr(module, "packing", module)
    return isinstance(module, BlockLinear) or bool(getattr(packing, "batch_invariant", False))


def block_linears(module: nn.Module, row_block: int) -> int:
    """Swap ``module``'s ``nn.Linear`` layers (row-parallel ones of one rank included) for
    ``BlockLinear`` in place, except those whose kernel is batch-invariant already; their
    products go through ``chosen_gemm()`` where it names one. Returns the layers swapped."""
    swapped, gemm = 0, chosen_gemm()
    for child in module.modules():
        if isinstance(child, nn.Linear) and not keeps_rows_apart(child):
            child.__class__ = BlockLinear
            layer = cast(BlockLinear, child)
            layer.row_block, layer.gemm = row_block, gemm
            swapped += 1
    return swapped
