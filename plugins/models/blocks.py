"""The building blocks the decoder skeleton (``decoder.py``), the draft heads and the vision
towers share: RMSNorm (``weight * x``) and Gemma's (``(1 + weight) * x``), each with the
add + RMSNorm the residual stream uses; the rotary embedding's frequencies and cos/sin tables;
HF ``hidden_act`` names as functions; and ``Unreduced``, a row-parallel output whose all-reduce
is left to the add + RMSNorm after it (``reduced`` resolves it).

RMSNorm and RoPE run on fused kernels where ``fused`` is set (``kernel_choice.py`` picks the ops
module: Triton on CUDA/ROCm, C++ on the CPU), else as the eager torch code below.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.plugins.models.eager_ops import rms_norm_eager


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.fused: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps)
        return rms_norm_eager(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return self(total), total


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x * (1 + weight)`` in float32, then cast (the stored weight is HF's,
    centred on 0). Always eager: the fused kernels multiply by ``weight`` itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + residual
        return self(total), total


class Unreduced(NamedTuple):
    """A row-parallel output (o_proj, down_proj) whose all-reduce is left to the add + RMSNorm
    after it (tensor parallelism: one fused kernel where the platform has one)."""

    partial: torch.Tensor


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 style scaling when the config asks for it. Reads both
    the classic ``rope_theta``/``rope_scaling`` fields and transformers 5's ``rope_parameters``."""
    raw = config.raw
    params = raw.get("rope_parameters") or {}
    base = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    dim = config.head_dim
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = raw.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in (None, "default"):
        raise ConfigError(
            f"config.json's rope_scaling type '{kind}' is not supported (supported: default, "
            "linear, llama3)"
        )
    # a Llama-3.x GGUF's scaling, as llama.cpp applies it: each frequency divided by its factor
    if (factors := raw.get("rope_freq_factors")) is not None:
        if len(factors) != inv_freq.numel():
            raise ConfigError(
                f"rope_freq_factors has {len(factors)} values; head_dim {dim} needs {dim // 2}"
            )
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    return inv_freq.float()


class RotaryEmbedding:
    """cos/sin tables indexed by position; HF's non-interleaved (rotate-half) layout."""

    def __init__(self, config: ModelConfig, device: str, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(config)
        t = torch.arange(config.max_context, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)
        self.fused: ModuleType | None = None
        # Eager path: full-width tables, sin signed for the rotated half, looked up once per
        # step (every layer gets the same positions tensor) instead of once per layer.
        self._cos2 = torch.cat((self.cos, self.cos), dim=-1)
        self._sin2 = torch.cat((-self.sin, self.sin), dim=-1)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def new_step(self) -> None:
        """Forget the last step's lookup (a captured graph must record its own)."""
        self._step = None

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        if self.fused is not None:
            return self.fused.rope(x, positions, self.cos, self.sin)
        if torch.compiler.is_compiling():
            # a traced step keeps no state between layers (the graph shares the lookup itself)
            cos, sin = self._cos2[positions].unsqueeze(1), self._sin2[positions].unsqueeze(1)
        else:
            # NOTE: holding ``positions`` keeps its id from being reused by a later step's tensor.
            if self._step is None or self._step[0] is not positions:
                cos, sin = self._cos2[positions].unsqueeze(1), self._sin2[positions].unsqueeze(1)
                self._step = (positions, cos, sin)
            _, cos, sin = self._step
        x1, x2 = x.chunk(2, dim=-1)
        # x1 * cos - x2 * sin, x2 * cos + x1 * sin: the same products and sums, in 4 ops
        return x * cos + torch.cat((x2, x1), dim=-1) * sin


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An HF ``hidden_act`` name as a function."""
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ConfigError(
        f"config.json's hidden_act '{name}' is not supported (supported: silu, gelu, gelu_tanh)"
    )


def reduced(h: Any, tp: Any) -> torch.Tensor:
    """A layer's output with its all-reduce done (``Unreduced`` -> the summed tensor)."""
    return tp.all_reduce(h.partial) if isinstance(h, Unreduced) else h
