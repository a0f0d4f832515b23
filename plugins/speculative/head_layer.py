"""What the EAGLE and EAGLE-3 draft heads share: the head directory's config.json, the one Llama
decoder layer, and loading and saving a head directory (config.json + model.safetensors).

A head is one decoder layer that reads, at row p, the token x(p+1) and a d-wide feature of
position p (the target's, or the head's own output one row back) and predicts x(p+2). The two
kinds differ only at the edges: how the token embedding and the feature enter the layer
(``DraftHead.inputs``) and which vocabulary the output is read in (``draft_logits``,
``to_target``). The attention step is left to the caller (``qkv`` then ``finish``): paged
through the attention plugin when serving (``head_draft.py``), dense with the training-time-test
mask when training (``tools/train_draft.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.plugins.models.blocks import RMSNorm, RotaryEmbedding

WEIGHTS_FILE = "model.safetensors"


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
    aux_layers: tuple[int, ...]  # EAGLE-3's fused target layers; empty for EAGLE
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    raw: dict[str, Any]

    @classmethod
    def shaped_like(cls, target: ModelConfig, **extra: Any) -> HeadConfig:
        """A head shaped like one layer of ``target``, with ``extra`` config.json keys."""
        return cls.from_dict({**layers_shaped_like(target), **extra})

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HeadConfig:
        try:
            layers = raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
            return cls(
                **layer_fields(raw),
                draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                aux_layers=tuple(int(i) for i in layers) if layers else (),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"draft head config.json is incomplete or malformed: {e}") from e

    @classmethod
    def from_dir(cls, path: str | Path) -> HeadConfig:
        return cls.from_dict(read_config_json(path, "draft head"))

    @property
    def architecture(self) -> str:
        return str((self.raw.get("architectures") or [""])[0])

    def model_config(self, max_context: int) -> ModelConfig:
        """The head as a one-layer ModelConfig (what an attention plugin and RoPE read)."""
        return model_config_of(self.raw, self.max_position_embeddings, max_context)


def layers_shaped_like(
    target: ModelConfig, num_layers: int = 1, intermediate_size: int | None = None
) -> dict[str, Any]:
    """The config.json keys of ``num_layers`` decoder layers shaped like ``target``'s (MLP
    ``intermediate_size`` wide, default the target's) that read the target's features: what
    every drafter's config starts from."""
    t = target.raw
    rope = t.get("rope_parameters") or {}
    return {
        "hidden_size": target.hidden_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "intermediate_size": intermediate_size or int(t["intermediate_size"]),
        "num_hidden_layers": num_layers,
        "vocab_size": target.vocab_size,
        "target_hidden_size": target.hidden_size,
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(t.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "max_position_embeddings": target.max_context,
        "hidden_act": "silu",
    }


def layer_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields every drafter's config reads alike from its config.json ``raw`` (the
    layers' shape, the target's vocabulary and feature width, RoPE), ``raw`` itself included.
    Raises KeyError, TypeError or ValueError on a malformed one."""
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    return {
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or hidden // heads),
        "intermediate_size": int(raw["intermediate_size"]),
        "vocab_size": int(raw["vocab_size"]),
        "target_hidden_size": int(raw.get("target_hidden_size") or hidden),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(raw.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
        "raw": raw,
    }


def read_config_json(path: str | Path, what: str) -> dict[str, Any]:
    """A drafter directory's config.json (``what`` names the kind of drafter in the error)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"{what} directory '{path}' has no config.json")
    raw: dict[str, Any] = json.loads(file.read_text())
    return raw


def weights_file(path: str | Path, what: str) -> Path:
    """A drafter directory's model.safetensors, which must be there."""
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise ConfigError(f"{what} directory '{path}' has no {WEIGHTS_FILE}")
    return file


def model_config_of(raw: dict[str, Any], max_positions: int, max_context: int) -> ModelConfig:
    """A drafter's config.json ``raw`` as a ModelConfig (what an attention plugin and RoPE
    read), its context the longer of its own ``max_positions`` and the engine's."""
    longest = max(max_context, max_positions)
    return ModelConfig.from_dict({**raw, "max_position_embeddings": longest})


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig, in_width: int) -> None:
        super().__init__()
        hd = c.head_dim
        self.q_proj = nn.Linear(in_width, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(in_width, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(in_width, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer whose attention reads ``in_width`` inputs; with ``input_norms``
    (EAGLE-3) it also has the norms of its two inputs (token embedding, feature)."""

    def __init__(self, c: HeadConfig, in_width: int, input_norms: bool) -> None:
        super().__init__()
        d = c.hidden_size
        if input_norms:
            self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
            self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.self_attn = _Attention(c, in_width)
        self.mlp = _MLP(c)


class DraftHead(nn.Module):
    """One decoder layer between two edges the subclasses define (``inputs``, ``draft_logits``).

    Subclasses build their modules in ``build`` (on the right device; RMSNorm weights start at
    one) and name the decoder layer in ``layer``."""

    layer: DecoderLayer
    #: its norms and RoPE see [tokens, ...] tensors, as the target's fused kernels take them
    #: (a platform may switch them to those: ``prepare_draft_head``)
    supports_fused_ops = True

    def __init__(self, config: HeadConfig, max_context: int, dtype: torch.dtype, device: str):
        super().__init__()
        self.config = config
        with torch.device(device):
            self.build(config)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.to(dtype)
        # NOTE: the eager RMSNorm and RoPE on every device: the head is one layer, and the
        # training tool needs their autograd.
        self.rope = RotaryEmbedding(config.model_config(max_context), device, dtype)

    def build(self, config: HeadConfig) -> None:
        raise NotImplementedError

    def inputs(
        self, embeds: torch.Tensor, feature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, the residual stream) from the token embeddings and the
        features (the target's, or the head's own output hidden states)."""
        raise NotImplementedError

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits over the head's vocabulary from its output hidden states."""
        raise NotImplementedError

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of ids in the head's vocabulary (the same by default)."""
        return draft_ids

    def qkv(
        self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, hd], k and v [T, kv_heads, hd] with RoPE applied, and the residual
        stream [T, d] that ``finish`` adds to."""
        c, attn = self.config, self.layer.self_attn
        x, residual = self.inputs(embeds, feature)
        t = x.shape[0]
        q = attn.q_proj(x).view(t, c.num_heads, c.head_dim)
        k = attn.k_proj(x).view(t, c.num_kv_heads, c.head_dim)
        v = attn.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        self.rope.new_step()
        return self.rope.apply(q, positions), self.rope.apply(k, positions), v, residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's output hidden state from attention's [T, heads * hd]."""
        layer = self.layer
        h = layer.self_attn.o_proj(attn_out) + residual
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def init_weights(self) -> None:
        """Every Linear normal(0, 0.02) from torch's global generator (RMSNorm weights stay
        one)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)


H = TypeVar("H", bound=DraftHead)


def load_head(
    cls: type[H], path: str | Path, max_context: int, dtype: torch.dtype, device: str
) -> H:
    """A ``cls`` head from a head directory, its tensors checked against its config.json."""
    config = HeadConfig.from_dir(path)
    file = weights_file(path, "draft head")
    head = cls(config, max_context, dtype, device)
    load_checked_weights(head, file, device, "draft head")
    return head


def load_checked_weights(head: nn.Module, file: Path, device: str, what: str) -> None:
    """Load ``file`` into ``head``, refusing any tensor name or shape its config does not imply
    (``what`` names the kind of head in the errors)."""
    from safetensors.torch import load_file

    state = load_file(str(file), device=str(device))
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"{what} '{file}' does not match its config.json: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConfigError(
                f"{what} '{file}': '{name}' has shape {tuple(tensor.shape)}, config.json "
                f"implies {tuple(expected[name].shape)}"
            )
    head.load_state_dict({n: t.to(expected[n].dtype) for n, t in state.items()})


def save_head(head: Any, path: str | Path, dtype: torch.dtype, extra: dict[str, Any]) -> None:
    """A head directory: config.json (``head.config.raw``, with ``extra`` under "radixserve")
    and model.safetensors, floating-point tensors in ``dtype``."""
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
