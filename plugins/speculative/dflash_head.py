"""The DFlash block drafter: a few Llama decoder layers that predict a block of tokens in one
parallel forward from the target's hidden features (a block-diffusion drafter, arXiv
2602.06036; research notes in SPECULATIVE.md section 3).

Shapes, with d the target's hidden size and B the block size:

- ``fc`` [len(target_layers) * d -> d] and ``hidden_norm``: the context feature of a position,
  from the outputs of some target layers at that position (``project``).
- per layer (``layers.N``): a Llama decoder layer. Its K and V are computed both from the
  context features (the "KV injection": one projection of a position's feature, at its own
  position, so it can be cached by KV slot like the target's KV) and from the block's own
  hidden states; Q only from the block. Block rows see every context position before the
  block and every row of the block (bidirectional).
- ``mask_embedding`` [d]: the input of block rows 1..B-1 (row 0 reads the last verified token
  through the target's embedding). A learned vector, so no vocabulary id is needed for it.
- ``norm`` [d]: before the target's own LM head, which the drafter shares and never stores.

Block row j (j >= 1) of a block at positions a .. a + B - 1 predicts the token at a + j.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.plugins.models.blocks import RMSNorm, rope_inv_freq
from radixserve.plugins.speculative.head_layer import (
    layer_fields,
    layers_shaped_like,
    load_checked_weights,
    model_config_of,
    read_config_json,
    weights_file,
)

ARCHITECTURE = "LlamaDFlashDrafter"


def default_target_layers(num_layers: int) -> list[int]:
    """Five layers spread from the second to the fourth from last (DFlash reads several)."""
    lo, hi = 1, max(1, num_layers - 4)
    return sorted({lo + (hi - lo) * i // 4 for i in range(5)})


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    vocab_size: int  # the target's
    target_hidden_size: int
    target_layers: tuple[int, ...]
    block_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    raw: dict[str, Any]

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        target_layers: list[int],
        block_size: int,
        num_layers: int = 1,
        intermediate_size: int | None = None,
    ) -> DFlashConfig:
        """A drafter shaped like ``num_layers`` layers of ``target``."""
        raw = {
            "architectures": [ARCHITECTURE],
            **layers_shaped_like(target, num_layers, intermediate_size),
            "dflash_config": {"target_layer_ids": list(target_layers), "block_size": block_size},
        }
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        try:
            dflash = raw["dflash_config"]
            return cls(
                **layer_fields(raw),
                num_layers=int(raw["num_hidden_layers"]),
                target_layers=tuple(int(i) for i in dflash["target_layer_ids"]),
                block_size=int(dflash["block_size"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"DFlash drafter config.json is incomplete or malformed: {e}") from e

    @classmethod
    def from_dir(cls, path: str | Path) -> DFlashConfig:
        return cls.from_dict(read_config_json(path, "DFlash drafter"))

    def model_config(self, max_context: int) -> ModelConfig:
        """The drafter as a ModelConfig (what RoPE reads)."""
        return model_config_of(self.raw, self.max_position_embeddings, max_context)


def block_attention_mask(ctx_lens: torch.Tensor, ctx_width: int, block: int) -> torch.Tensor:
    """[n, B, ctx_width + B] bool: block i's rows see context keys 0 .. ctx_lens[i] - 1 and
    every key of their own block."""
    keys = torch.arange(ctx_width, device=ctx_lens.device)
    ctx = keys[None, :] < ctx_lens[:, None]  # [n, W]
    own = torch.ones(len(ctx_lens), block, dtype=torch.bool, device=ctx_lens.device)
    return torch.cat([ctx, own], dim=1)[:, None, :].expand(-1, block, -1)


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.q_proj = nn.Linear(d, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, d, bias=False)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashHead(nn.Module):
    def __init__(self, config: DFlashConfig, max_context: int, dtype: torch.dtype, device: str):
        super().__init__()
        c = self.config = config
        d = c.hidden_size
        with torch.device(device):
            self.fc = nn.Linear(len(c.target_layers) * c.target_hidden_size, d, bias=False)
            self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
            self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
            self.norm = RMSNorm(d, c.rms_norm_eps)
            self.mask_embedding = nn.Parameter(torch.zeros(d))
        self._reset_norms()
        self.to(dtype)
        # rotate-half RoPE tables as in the target (HF layout), eager: training needs autograd
        mc = c.model_config(max_context)
        freqs = torch.outer(torch.arange(mc.max_context, dtype=torch.float32), rope_inv_freq(mc))
        self._cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(device=device, dtype=dtype)
        self._sin = torch.cat((-freqs.sin(), freqs.sin()), -1).to(device=device, dtype=dtype)

    def _reset_norms(self) -> None:
        for m in self.modules():
            if isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def init_weights(self, std: float = 0.02) -> None:
        """A fresh drafter: small normal weights, unit norms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
        nn.init.normal_(self.mask_embedding, std=std)
        self._reset_norms()

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., heads, hd] at ``positions`` [...]."""
        cos, sin = self._cos[positions].unsqueeze(-2), self._sin[positions].unsqueeze(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * sin

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Context features [..., k * d] (the target layers' outputs, concatenated) -> [..., d]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(
        self, ctx: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K (RoPE applied) and V [..., kv_heads, hd] of projected context features
        ``ctx`` [..., d] at ``positions``: what the serving plugin caches by KV slot."""
        c = self.config
        shape = (*ctx.shape[:-1], c.num_kv_heads, c.head_dim)
        return [
            (self.rope(layer.k_proj(ctx).view(shape), positions), layer.v_proj(ctx).view(shape))
            for layer in self.layers
        ]

    def block_inputs(self, first: torch.Tensor) -> torch.Tensor:
        """[n, B, d]: the embedded last verified token ``first`` [n, d], then the mask."""
        rest = self.mask_embedding.to(first.dtype).expand(
            first.shape[0], self.config.block_size - 1, -1
        )
        return torch.cat([first[:, None, :], rest], dim=1)

    def run_block(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """The blocks' hidden states [n, B, d] (before ``norm``) from their inputs ``x``
        [n, B, d] at ``positions`` [n, B], each layer's context K/V (RoPE applied) and
        ``mask`` [n, B, W + B] (``block_attention_mask``). Context K/V are [n, W, kv_heads,
        hd], one context per block (serving: one request each), or [W, kv_heads, hd], one
        context that every block reads up to its own start (training: the blocks of one
        sequence), which is never copied per block."""
        c = self.config
        n, b = x.shape[:2]
        g = c.num_heads // c.num_kv_heads
        scale = c.head_dim**-0.5
        shared = ctx_kv[0][0].dim() == 3
        hide = ~mask[:, None, None]  # [n, 1, 1, B, W + B]
        h = x
        for layer, (k_ctx, v_ctx) in zip(self.layers, ctx_kv, strict=True):
            y = layer.input_layernorm(h)
            q = self.rope(layer.q_proj(y).view(n, b, c.num_heads, c.head_dim), positions)
            k = self.rope(layer.k_proj(y).view(n, b, c.num_kv_heads, c.head_dim), positions)
            v = layer.v_proj(y).view(n, b, c.num_kv_heads, c.head_dim)
            q = q.view(n, b, c.num_kv_heads, g, c.head_dim)
            ctx_eq = "nbkgd,wkd->nkgbw" if shared else "nbkgd,nwkd->nkgbw"
            scores = torch.cat(
                [torch.einsum(ctx_eq, q, k_ctx), torch.einsum("nbkgd,nckd->nkgbc", q, k)], -1
            )
            probs = torch.softmax((scores * scale).float().masked_fill(hide, float("-inf")), -1)
            probs = probs.to(v.dtype)
            w = scores.shape[-1] - b
            ctx_out_eq = "nkgbw,wkd->nbkgd" if shared else "nkgbw,nwkd->nbkgd"
            out = torch.einsum(ctx_out_eq, probs[..., :w], v_ctx)
            out = out + torch.einsum("nkgbc,nckd->nbkgd", probs[..., w:], v)
            h = h + layer.o_proj(out.reshape(n, b, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h


def load_head(path: str | Path, max_context: int, dtype: torch.dtype, device: str) -> DFlashHead:
    config = DFlashConfig.from_dir(path)
    file = weights_file(path, "DFlash drafter")
    head = DFlashHead(config, max_context, dtype, device)
    load_checked_weights(head, file, device, "DFlash drafter")
    return head
