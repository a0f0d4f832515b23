"""Gemma 2 text models (``Gemma2ForCausalLM``) on the decoder skeleton (``decoder.py``).

What differs from Llama, each through one extension point:
- RMSNorm multiplies by ``1 + weight`` (``norm_cls = GemmaRMSNorm``);
- the embeddings are scaled by sqrt(hidden_size) (``embed``) and the LM head is tied by default;
- the MLP is gelu-tanh gated (``hidden_activation``, read by the skeleton's ``build_mlp``);
- sandwich norms: the attention output is normed before it joins the residual stream
  (``post_attention_layernorm``), the MLP input is ``pre_feedforward_layernorm`` of the stream
  and its output is normed again (``post_feedforward_layernorm``): ``mlp_input``/``mlp_output``;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped
  (``attn_logit_softcapping``), sliding-window attention on the layers ``layer_types`` marks
  (every other layer, from the first): ``attention_options``, handled by the attention backend;
- the final logits are soft-capped (``final_logit_softcapping``): ``logits``.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.core.config import ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.parallel import SINGLE, TensorParallel
from radixserve.plugins.models.blocks import GemmaRMSNorm
from radixserve.plugins.models.decoder import DecoderForCausalLM, DecoderLayer


def gemma2_layer_types(raw: dict[str, Any]) -> list[str]:
    types = raw.get("layer_types")
    if types:
        return list(types)
    n = int(raw["num_hidden_layers"])
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]


class Gemma2Layer(DecoderLayer):
    norm_cls = GemmaRMSNorm

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        attention: AttentionBackend,
        group: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(config, layer_id, attention, group)
        eps = float(config.raw.get("rms_norm_eps", 1e-6))
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        raw = config.raw
        options: dict[str, Any] = {"scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5}
        window = raw.get("sliding_window")
        if window and gemma2_layer_types(raw)[self.layer_id] == "sliding_attention":
            options["sliding_window"] = int(window)
        cap = raw.get("attn_logit_softcapping")
        if cap:
            options["logit_softcap"] = float(cap)
        return options

    def mlp_input(
        self, attn: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pre_feedforward_layernorm.add_forward(
            self.post_attention_layernorm(attn), residual
        )

    def mlp_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(out)


class Gemma2ForCausalLM(DecoderForCausalLM):
    layer_cls = Gemma2Layer
    default_tie_word_embeddings = True

    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        dtype: torch.dtype,
        device: str,
        group: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(config, attention, dtype, device, group)
        # HF rounds the normalizer to the weights' dtype
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype).item()
        cap = config.raw.get("final_logit_softcapping")
        self.final_logit_softcap = float(cap) if cap else 0.0

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().logits(h)
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


def build_gemma2(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> Gemma2ForCausalLM:
    return Gemma2ForCausalLM(config, attention, dtype, device, group)


@hookimpl
def register_models(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "Gemma2ForCausalLM",
        build_gemma2,
        description="Gemma 2 (soft-capping, sliding-window layers, scaled embeddings)",
    )
