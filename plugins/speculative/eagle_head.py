"""The EAGLE (EAGLE-1/2) draft head: fc([token embedding ; target's last hidden state]) then one
decoder layer, read through the target's own LM head over its full vocabulary.

Shapes, with d the target's hidden size:

- ``fc``: [2d -> d] over the concatenation of the token's embedding (the target's, shared and
  frozen) and the feature; its output is both the attention's input and the residual stream.
- ``layers.0``: a Llama decoder layer without an input norm (EAGLE's first layer has none: the
  fc output goes straight in), attention over d inputs.
- no final norm and no LM head of its own: the head's output hidden state goes through the
  target's LM head (``bind_lm_head``), and is fed back unchanged as the next step's feature.

The feature is the target's **last hidden state before its LM head**: the residual stream
after the last layer, through the target's final norm (what EAGLE's and SGLang's targets hand
their EAGLE drafters). The serving plugin captures the last layer's output and applies the
target's norm (``eagle.py``); the training tool does the same; a head trained on one and
served on the other would read features of the wrong scale.

Checkpoint names follow EAGLE's and SGLang's ``LlamaForCausalLMEagle`` (``fc.weight``,
``layers.0.self_attn.q_proj.weight`` ...). The config, decoder layer, loading and saving are
shared with the EAGLE-3 head (``head_layer.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from radixserve.core.config import ModelConfig
from radixserve.plugins.speculative.head_layer import (
    DecoderLayer,
    DraftHead,
    HeadConfig,
    load_head,
)

ARCHITECTURE = "LlamaForCausalLMEagle"


def eagle_config(target: ModelConfig) -> HeadConfig:
    """An EAGLE head shaped like one layer of ``target`` (its full vocabulary)."""
    return HeadConfig.shaped_like(target, architectures=[ARCHITECTURE])


class EagleHead(DraftHead):
    def build(self, c: HeadConfig) -> None:
        d = c.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(c, d, input_norms=False)])
        self._lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def layer(self) -> DecoderLayer:  # type: ignore[override]
        return self.layers[0]  # type: ignore[return-value]

    def bind_lm_head(self, lm_head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The target's LM head: hidden states [T, d] -> float32 logits [T, vocab]."""
        self._lm_head = lm_head

    def inputs(
        self, embeds: torch.Tensor, feature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((embeds, feature.to(embeds.dtype)), dim=-1))
        return x, x

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        assert self._lm_head is not None, "bind_lm_head first"
        return self._lm_head(h).float()


def load_eagle_head(
    path: str | Path, max_context: int, dtype: torch.dtype, device: str
) -> EagleHead:
    return load_head(EagleHead, path, max_context, dtype, device)


def new_eagle_head(
    target: ModelConfig, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> EagleHead:
    """A freshly initialised head for ``target``; bind the target's LM head before drafting."""
    torch.manual_seed(seed)
    head = EagleHead(eagle_config(target), target.max_context, dtype, device)
    head.init_weights()
    return head


def tied_lm_head(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """An LM head from its weight [vocab, d] (the tied embedding, or the untied head)."""
    return lambda h: torch.nn.functional.linear(h, weight.to(h.dtype))
