"""The EAGLE-3 draft head: one decoder layer over [token embedding, fused target features].

Shapes, with d the target's hidden size:

- ``fc``: [3d -> d], fuses the target's low, middle and high layer outputs (the residual
  stream after each of ``eagle_config.eagle_aux_hidden_state_layer_ids``) into one feature.
  The head's own output hidden state (already d wide) is fed back unchanged on later draft
  steps, which is what training-time test teaches it to read.
- ``midlayer``: a Llama decoder layer whose attention reads 2d inputs: the RMS-normed token
  embedding (the target's, shared and frozen) beside the RMS-normed feature
  (``hidden_norm``); the feature, not the embedding, is the residual stream.
- ``norm`` and ``lm_head`` over a reduced draft vocabulary of ``draft_vocab_size`` tokens;
  ``d2t[i]`` is the offset from draft id i to its target id (target = i + d2t[i], SpecForge's
  convention), ``t2d`` marks the target ids the head can draft.

Token at position p: the head's row p reads token x(p+1) with the target's feature of position
p (or its own output at p - 1) and predicts x(p+2). Checkpoint names follow SpecForge
(``midlayer.self_attn.q_proj.weight`` ...), so ``state_dict`` is the safetensors file.

The attention step is left to the caller (``qkv`` then ``finish``): paged through the attention
plugin when serving (``plugins/speculative/eagle3.py``), dense with the training-time-test mask
when training (``tools/train_draft.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.plugins.models.decoder import RMSNorm, RotaryEmbedding

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"


def default_aux_layers(num_layers: int) -> list[int]:
    """SpecForge's default low, middle and high layers for a target of ``num_layers``."""
    return [1, num_layers // 2 - 1, num_layers - 4]


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    raw: dict[str, Any]

    @classmethod
    def for_target(
        cls, target: ModelConfig, draft_vocab_size: int, aux_layers: list[int] | None = None
    ) -> HeadConfig:
        """A head shaped like one layer of ``target``."""
        t = target.raw
        rope = t.get("rope_parameters") or {}
        raw = {
            "architectures": [ARCHITECTURE],
            "hidden_size": target.hidden_size,
            "num_attention_heads": target.num_heads,
            "num_key_value_heads": target.num_kv_heads,
            "head_dim": target.head_dim,
            "intermediate_size": int(t["intermediate_size"]),
            "num_hidden_layers": 1,
            "vocab_size": target.vocab_size,
            "draft_vocab_size": draft_vocab_size,
            "target_hidden_size": target.hidden_size,
            "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(t.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            "max_position_embeddings": target.max_context,
            "hidden_act": "silu",
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": aux_layers
                or default_aux_layers(target.num_layers)
            },
        }
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HeadConfig:
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
            return cls(
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                target_hidden_size=int(raw.get("target_hidden_size") or hidden),
                aux_layers=tuple(int(i) for i in layers) if layers else (),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                raw=raw,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"EAGLE-3 head config.json is incomplete or malformed: {e}") from e

    @classmethod
    def from_dir(cls, path: str | Path) -> HeadConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"EAGLE-3 head directory '{path}' has no config.json")
        return cls.from_dict(json.loads(file.read_text()))

    def model_config(self, max_context: int) -> ModelConfig:
        """The head as a one-layer ModelConfig (what an attention plugin and RoPE read)."""
        longest = max(max_context, self.max_position_embeddings)
        raw = {**self.raw, "max_position_embeddings": longest}
        return ModelConfig.from_dict(raw)


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(2 * d, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, d, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        d = c.hidden_size
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


class Eagle3Head(nn.Module):
    def __init__(self, config: HeadConfig, max_context: int, dtype: torch.dtype, device: str):
        super().__init__()
        c = self.config = config
        d = c.hidden_size
        with torch.device(device):
            self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, d, bias=False)
            self.midlayer = _MidLayer(c)
            self.norm = RMSNorm(d, c.rms_norm_eps)
            self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        for norm in (self.norm, self.midlayer.input_layernorm, self.midlayer.hidden_norm,
                     self.midlayer.post_attention_layernorm):  # fmt: skip
            nn.init.ones_(norm.weight)
        self.to(dtype)
        # NOTE: the eager RMSNorm and RoPE on every device: the head is one layer, and the
        # training tool needs their autograd.
        self.rope = RotaryEmbedding(c.model_config(max_context), device, dtype)

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft id i drafts target id ``target_ids[i]``."""
        ids = target_ids.to(self.d2t.device, torch.int64)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The d-wide feature: the fused target layers, or the head's own output as is."""
        return self.fc(hidden) if hidden.shape[-1] != self.config.hidden_size else hidden

    def qkv(
        self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, hd], k and v [T, kv_heads, hd], RoPE applied."""
        c, layer = self.config, self.midlayer
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(feature)), dim=-1)
        attn = layer.self_attn
        t = x.shape[0]
        q = attn.q_proj(x).view(t, c.num_heads, c.head_dim)
        k = attn.k_proj(x).view(t, c.num_kv_heads, c.head_dim)
        v = attn.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        self.rope.new_step()
        return self.rope.apply(q, positions), self.rope.apply(k, positions), v

    def finish(self, attn_out: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """The layer's output hidden state (before ``norm``) from attention's [T, heads * hd]."""
        layer = self.midlayer
        h = layer.self_attn.o_proj(attn_out) + feature
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(h)).float()


def load_head(path: str | Path, max_context: int, dtype: torch.dtype, device: str) -> Eagle3Head:
    from safetensors.torch import load_file

    config = HeadConfig.from_dir(path)
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise ConfigError(f"EAGLE-3 head directory '{path}' has no {WEIGHTS_FILE}")
    head = Eagle3Head(config, max_context, dtype, device)
    state = load_file(str(file), device=str(device))
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"EAGLE-3 head '{file}' does not match its config.json: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConfigError(
                f"EAGLE-3 head '{file}': '{name}' has shape {tuple(tensor.shape)}, config.json "
                f"implies {tuple(expected[name].shape)}"
            )
    head.load_state_dict({n: t.to(expected[n].dtype) for n, t in state.items()})
    return head


def save_head(
    head: Eagle3Head, path: str | Path, dtype: torch.dtype, extra: dict[str, Any]
) -> None:
    """config.json (with ``extra`` under "radixserve") and model.safetensors in ``dtype``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        n: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
        for n, t in head.state_dict().items()
    }
    save_file(state, str(out / WEIGHTS_FILE))
    raw = {**head.config.raw, "torch_dtype": str(dtype).removeprefix("torch."), "radixserve": extra}
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def new_head(
    target: ModelConfig,
    embed_weight: torch.Tensor,
    draft_ids: torch.Tensor,
    seed: int = 0,
    aux_layers: list[int] | None = None,
    device: str = "cpu",
) -> Eagle3Head:
    """A freshly initialised float32 head on ``device`` for ``target``: the draft vocabulary is
    ``draft_ids`` (target ids, most useful first) and its LM head starts as their rows of the
    target's tied embedding (a head start: the target's own output space)."""
    config = HeadConfig.for_target(target, len(draft_ids), aux_layers)
    torch.manual_seed(seed)
    head = Eagle3Head(config, target.max_context, torch.float32, device)
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
    head.set_draft_vocab(draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(embed_weight[draft_ids.long()].float().to(device))
    return head
