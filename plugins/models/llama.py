"""Llama-family model (Llama-2/3, Mistral-style, SmolLM2) for batched, paged inference.

Projections are fused (qkv, gate_up) to cut per-step kernel launches; attention goes through the
selected attention plugin, which owns the paged KV access. The residual stream is carried beside
each layer's output so the residual add and the next RMSNorm can be one kernel: on CUDA/ROCm
devices add+RMSNorm, RoPE and SiLU-mul run as single Triton kernels (``fused_ops.py``), elsewhere
as the eager torch code below (same rounding steps).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import AttentionBackend, CausalLM

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.fused: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return self(total), total


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 style scaling when the config asks for it."""
    raw = config.raw
    base = float(raw.get("rope_theta", 10000.0))
    dim = config.head_dim
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = raw.get("rope_scaling") or {}
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
        raise NotImplementedError(
            f"rope_scaling type '{kind}' is not supported by the llama plugin"
        )
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

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        if self.fused is not None:
            return self.fused.rope(x, positions, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, attention: AttentionBackend) -> None:
        super().__init__()
        raw = config.raw
        self.layer_id = layer_id
        self.attention = attention
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(raw.get("attention_bias", False))
        eps = float(raw.get("rms_norm_eps", 1e-6))
        inter = int(raw["intermediate_size"])
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.fused: ModuleType | None = None

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """h: the previous layer's output (the embeddings for layer 0), residual: the stream it
        adds to (None for layer 0). Returns (this layer's MLP output, the stream before it)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        qkv = self.qkv_proj(x)
        t, qk_size = h.shape[0], self.q_size + self.kv_size
        # q and k heads rotate alike: one RoPE over both (one kernel launch on a GPU)
        qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = rope.apply(qk, batch.positions)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        attn = self.o_proj(self.attention.forward(q, k, v, self.layer_id, batch))
        x, residual = self.post_attention_layernorm.add_forward(attn, residual)
        gate_up = self.gate_up_proj(x)
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(gate_up)), residual
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up), residual


class LlamaForCausalLM(nn.Module, CausalLM):
    def __init__(
        self, config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: str
    ) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(config.raw.get("tie_word_embeddings", False))
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                LlamaLayer(config, i, attention) for i in range(config.num_layers)
            )
            self.norm = RMSNorm(config.hidden_size, float(config.raw.get("rms_norm_eps", 1e-6)))
            if not self.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # NOTE: cast on the meta device first: allocating in float32 and casting after would
        # need twice a bfloat16 model's memory at start-up (the KV pool already holds the rest).
        self.to(dtype)
        self.to_empty(device=device)
        self.rope = RotaryEmbedding(config, device, dtype)
        fused = fused_ops_for(device)
        for part in (self.rope, *self.modules()):
            if hasattr(part, "fused"):
                part.fused = fused

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h, residual = self.embed_tokens(batch.input_ids), None
        capture = batch.capture_hidden_layers
        if capture:
            batch.hidden_states = {}
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, self.rope, batch)
            if i in capture:
                batch.hidden_states[i] = h + residual  # type: ignore[index]
        rows = batch.logits_indices
        if residual is None:  # a model without layers
            h = self.norm(h[rows])
        else:
            h = self.norm.add_forward(h[rows], residual[rows])[0]
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(h, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, offset = _fused_target(name, self)
            if target not in params:
                raise ValueError(f"unexpected weight '{name}' for {self.config.architecture}")
            param = params[target]
            with torch.no_grad():
                rows = tensor.shape[0]
                dst = param.data[offset : offset + rows] if offset is not None else param.data
                if dst.shape != tensor.shape:
                    raise ValueError(
                        f"weight '{name}' has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
            loaded.add(f"{target}@{offset}")
        expected = {f"{t}@{o}" for t, o in _expected_slots(self)}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights: {', '.join(sorted(missing)[:5])} ...")


def fused_ops_for(device: str) -> ModuleType | None:
    """The Triton ops module on a CUDA/ROCm device with Triton installed, else None."""
    if torch.device(device).type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from radixserve.plugins.models import fused_ops

    return fused_ops


def _fused_target(name: str, model: LlamaForCausalLM) -> tuple[str, int | None]:
    """Map an HF weight name to (our parameter name, row offset in a fused matrix)."""
    if ".self_attn." in name:
        prefix, _, leaf = name.partition(".self_attn.")
        proj, _, kind = leaf.partition(".")
        layer = model.layers[0]
        offsets = {"q_proj": 0, "k_proj": layer.q_size, "v_proj": layer.q_size + layer.kv_size}
        if proj in offsets:
            return f"{prefix}.qkv_proj.{kind}", offsets[proj]
        return f"{prefix}.{proj}.{kind}", None
    if ".mlp." in name:
        prefix, _, leaf = name.partition(".mlp.")
        proj, _, kind = leaf.partition(".")
        inter = int(model.config.raw["intermediate_size"])
        if proj in ("gate_proj", "up_proj"):
            return f"{prefix}.gate_up_proj.{kind}", 0 if proj == "gate_proj" else inter
        return f"{prefix}.{proj}.{kind}", None
    return name, None


def _expected_slots(model: LlamaForCausalLM) -> list[tuple[str, int | None]]:
    slots: list[tuple[str, int | None]] = []
    layer0 = model.layers[0]
    inter = int(model.config.raw["intermediate_size"])
    for name, _ in model.named_parameters():
        if ".qkv_proj." in name:
            slots += [(name, 0), (name, layer0.q_size), (name, layer0.q_size + layer0.kv_size)]
        elif ".gate_up_proj." in name:
            slots += [(name, 0), (name, inter)]
        else:
            slots.append((name, None))
    return slots


def build_llama(
    config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: str
) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, attention, dtype, device)


@hookimpl
def register_models(register) -> None:  # type: ignore[no-untyped-def]
    for arch in ARCHITECTURES:
        register(arch, build_llama, description="Llama family (Llama-2/3, Mistral, SmolLM2)")
