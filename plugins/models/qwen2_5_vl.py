"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2-VL (``qwen2_vl.py``) with another
vision tower. Its blocks have RMSNorms and a gated SiLU MLP, and most of them attend within
windows (``window_size`` pixels square, i.e. ``window_size / patch / merge`` merged blocks a
side) instead of over the whole image; the blocks of ``fullatt_block_indexes`` attend over the
whole image. For that the tower reorders the patches window by window (whole merge blocks, row
by row inside a window), runs the blocks and the merger (RMSNorm, then the MLP) in that order,
and puts the merged tokens back in the image's row-major order afterwards.

The rest is Qwen2-VL's: the 2-D rotary table of the vision attention, the Qwen2 decoder with
M-RoPE (for images the same 3-D positions as Qwen2-VL's), the image processor and the
``<|image_pad|>`` expansion on the tokenizer side.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixserve.core.config import ModelConfig
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.parallel import SINGLE, TensorParallel
from radixserve.plugins.models.blocks import activation
from radixserve.plugins.models.eager_ops import rms_norm_eager
from radixserve.plugins.models.qwen2_vl import (
    PatchMerger,
    PatchVisionTower,
    Qwen2VLForConditionalGeneration,
    VisionAttention,
    VisionBlock,
    image_processor,
    mrope_as_default,
    segments,
)


class VisionRMSNorm(nn.Module):
    """The vision tower's RMSNorm, always eager (it has no ``fused`` attribute, so the
    decoder's fused kernels are not attached to it)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_eager(x, self.weight, self.eps)


class GatedVisionMlp(nn.Module):
    """``down(act(gate(x)) * up(x))``, every projection with a bias."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def window_order(
    grids: list[tuple[int, ...]], merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """(the merged blocks' indices in window order, the patches of each window).

    A frame's h/merge x w/merge grid of merged blocks is cut into ``window`` x ``window``
    tiles from its top-left corner (those on the right and bottom edges smaller), taken row by
    row; inside a tile its blocks row by row. Indices count across all the images' frames."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = torch.arange(t * rows * cols).view(t, rows, cols) + base
        for frame in index:
            for r in range(0, rows, window):
                for c in range(0, cols, window):
                    tile = frame[r : r + window, c : c + window].flatten()
                    order.append(tile)
                    lengths.append(tile.numel() * merge * merge)
        base += t * rows * cols
    return torch.cat(order), lengths


class WindowedVisionTower(PatchVisionTower):
    """Qwen2.5-VL's vision tower (parameter names as the checkpoint's ``visual.*``)."""

    def __init__(self, vc: dict[str, Any]) -> None:
        dim, heads = int(vc["hidden_size"]), int(vc["num_heads"])
        super().__init__(vc, dim, heads)
        hidden, act = int(vc["intermediate_size"]), str(vc.get("hidden_act", "silu"))
        self.blocks = nn.ModuleList(
            VisionBlock(
                VisionAttention(dim, heads),
                GatedVisionMlp(dim, hidden, act),
                VisionRMSNorm(dim),
                VisionRMSNorm(dim),
            )
            for _ in range(int(vc["depth"]))
        )
        self.merger = PatchMerger(int(vc["out_hidden_size"]), dim, self.merge, VisionRMSNorm(dim))
        #: a window's side in merged blocks
        self.window = max(1, int(vc.get("window_size", 112)) // self.merge // self.patch)
        self.full_blocks = frozenset(int(i) for i in vc.get("fullatt_block_indexes", ()))

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, ...]]) -> torch.Tensor:
        order, lengths = window_order(grids, self.merge, self.window)
        unit = self.merge * self.merge
        # the patches of each merged block stay together: permute whole blocks
        patches = (order.unsqueeze(1) * unit + torch.arange(unit)).flatten()
        x = self.embed_patches(pixels)
        patches = patches.to(x.device)
        x = x[patches]
        cos, sin = self.rotary(self.positions(grids).to(x.device)[patches])
        frames = segments(self.frame_lengths(grids), x.device)
        windows = segments(lengths, x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_blocks else windows)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[order.to(merged.device)] = merged
        return out


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801
    """Registered by ``qwen2.py`` (the Qwen2 plugin)."""

    vision_cls = WindowedVisionTower


def build_qwen2_5_vl(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> Qwen2_5_VLForConditionalGeneration:
    return Qwen2_5_VLForConditionalGeneration(
        mrope_as_default(config), attention, dtype, device, group
    )


# the tokenizer side is Qwen2-VL's (the same image processor and placeholder expansion)
build_qwen2_5_vl.image_processor = image_processor  # type: ignore[attr-defined]
