"""Llama-family model (Llama-2/3, Mistral-style, SmolLM2) for batched, paged inference.

The decoder skeleton itself (fused qkv/gate_up projections, RMSNorm carried beside the residual
stream, RoPE, the Triton fused ops on CUDA/ROCm, weight loading) is ``decoder.py``; Llama is
that skeleton with no changes. ``RMSNorm``, ``RotaryEmbedding``, ``rope_inv_freq``
(``blocks.py``) and ``fused_ops_for`` (``kernel_choice.py``) are re-exported for code that
imported them from here.
"""

from __future__ import annotations

import torch

from radixserve.core.config import ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.parallel import SINGLE, TensorParallel
from radixserve.plugins.models.blocks import RMSNorm, RotaryEmbedding, rope_inv_freq
from radixserve.plugins.models.decoder import DecoderForCausalLM, DecoderLayer
from radixserve.plugins.models.kernel_choice import fused_ops_for

__all__ = [
    "ARCHITECTURES",
    "LlamaForCausalLM",
    "LlamaLayer",
    "RMSNorm",
    "RotaryEmbedding",
    "build_llama",
    "fused_ops_for",
    "rope_inv_freq",
]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


class LlamaLayer(DecoderLayer):
    def attention_options(self, config: ModelConfig) -> dict[str, object]:
        # Mistral slides every layer when the config sets a window; Llama has none (transformers'
        # Llama ignores a ``sliding_window`` field).
        window = config.raw.get("sliding_window")
        if window and config.architecture == "MistralForCausalLM":
            return {"sliding_window": int(window)}
        return {}


class LlamaForCausalLM(DecoderForCausalLM):
    layer_cls = LlamaLayer


def build_llama(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, attention, dtype, device, group)


@hookimpl
def register_models(register) -> None:  # type: ignore[no-untyped-def]
    for arch in ARCHITECTURES:
        register(arch, build_llama, description="Llama family (Llama-2/3, Mistral, SmolLM2)")
    from radixserve.plugins.models.llava import build_llava

    register(
        "LlavaForConditionalGeneration",
        build_llava,
        description="LLaVA-1.5 style (CLIP vision tower, projector, Llama)",
    )
    from radixserve.plugins.models import idefics3

    for arch in idefics3.ARCHITECTURES:
        register(
            arch,
            idefics3.build_idefics3,
            description="Idefics3 / SmolVLM (SigLIP image tiles, pixel-shuffle connector, Llama)",
        )
