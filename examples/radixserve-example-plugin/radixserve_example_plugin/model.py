"""``ExampleLlamaForCausalLM``: radixserve's Llama with its logits multiplied by ``logit_scale``.

``logit_scale`` is read from the model's ``config.json`` (default 1.0, which gives exactly the
built-in Llama). A scale above 1 sharpens the next-token distribution, below 1 flattens it, and
0 makes every token equally likely. Everything else (weights, attention, paged KV cache) is the
built-in Llama's, so the subclass only overrides ``__init__`` and ``forward``.
"""

from __future__ import annotations

import math

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.interfaces import AttentionBackend
from radixserve.plugins.models.llama import LlamaForCausalLM


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    def __init__(
        self, config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype, device: str
    ) -> None:
        super().__init__(config, attention, dtype, device)
        self.logit_scale = read_logit_scale(config.raw)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        # CausalLM contract: float32 logits [len(batch.logits_indices), vocab].
        return super().forward(batch) * self.logit_scale


def read_logit_scale(raw_config: dict[str, object]) -> float:
    """``config.json``'s ``logit_scale``: a finite number >= 0, 1.0 when absent."""
    value = raw_config.get("logit_scale", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config.json logit_scale must be a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"config.json logit_scale must be a finite number >= 0, got {value}")
    return float(value)
