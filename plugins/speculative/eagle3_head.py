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

The config, the decoder layer, loading and saving are shared with the EAGLE head
(``head_layer.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from radixserve.core.config import ModelConfig
from radixserve.plugins.models.blocks import RMSNorm
from radixserve.plugins.speculative.head_layer import (
    DecoderLayer,
    DraftHead,
    HeadConfig,
    save_head,
)
from radixserve.plugins.speculative.head_layer import load_head as _load_head

__all__ = ["Eagle3Head", "HeadConfig", "load_head", "new_head", "save_head"]

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> list[int]:
    """SpecForge's default low, middle and high layers for a target of ``num_layers``."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def eagle3_config(
    target: ModelConfig, draft_vocab_size: int, aux_layers: list[int] | None = None
) -> HeadConfig:
    """An EAGLE-3 head shaped like one layer of ``target``."""
    layers = aux_layers or default_aux_layers(target.num_layers)
    return HeadConfig.shaped_like(
        target,
        architectures=[ARCHITECTURE],
        draft_vocab_size=draft_vocab_size,
        eagle_config={"eagle_aux_hidden_state_layer_ids": layers},
    )


class Eagle3Head(DraftHead):
    def build(self, c: HeadConfig) -> None:
        d = c.hidden_size
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, d, bias=False)
        self.midlayer = DecoderLayer(c, 2 * d, input_norms=True)
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    @property
    def layer(self) -> DecoderLayer:  # type: ignore[override]
        return self.midlayer

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft id i drafts target id ``target_ids[i]``."""
        ids = target_ids.to(self.d2t.device, torch.int64)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The d-wide feature: the fused target layers, or the head's own output as is."""
        return self.fc(hidden) if hidden.shape[-1] != self.config.hidden_size else hidden

    def inputs(
        self, embeds: torch.Tensor, feature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The feature, not the embedding, is the residual stream.
        layer, feature = self.midlayer, self.features(feature)
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(feature)), dim=-1)
        return x, feature

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(h)).float()


def load_head(path: str | Path, max_context: int, dtype: torch.dtype, device: str) -> Eagle3Head:
    return _load_head(Eagle3Head, path, max_context, dtype, device)


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
    config = eagle3_config(target, len(draft_ids), aux_layers)
    torch.manual_seed(seed)
    head = Eagle3Head(config, target.max_context, torch.float32, device)
    head.init_weights()
    head.set_draft_vocab(draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(embed_weight[draft_ids.long()].float().to(device))
    return head
