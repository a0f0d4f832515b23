"""Qwen2 (``Qwen2ForCausalLM``): the Llama decoder with biases on the q, k and v projections.

The whole family difference is one extension point of the decoder skeleton (``decoder.py``):
``attention_biases``. Sliding-window layers, when a config enables them (``use_sliding_window``:
``layer_types``, or without it the layers from ``max_window_layers`` on), come from the skeleton.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.core.config import ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.parallel import SINGLE, TensorParallel
from radixserve.plugins.models.decoder import DecoderForCausalLM, DecoderLayer


class Qwen2Layer(DecoderLayer):
    def attention_biases(self, raw: dict[str, Any]) -> tuple[bool, bool]:
        return True, False  # q/k/v carry a bias, o_proj does not


class Qwen2ForCausalLM(DecoderForCausalLM):
    layer_cls = Qwen2Layer


def build_qwen2(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(config, attention, dtype, device, group)


@hookimpl
def register_models(register) -> None:  # type: ignore[no-untyped-def]
    register("Qwen2ForCausalLM", build_qwen2, description="Qwen2 / Qwen2.5 (QKV bias)")
    from radixserve.plugins.models.qwen2_vl import build_qwen2_vl

    register(
        "Qwen2VLForConditionalGeneration",
        build_qwen2_vl,
        description="Qwen2-VL (vision tower, M-RoPE)",
    )
    from radixserve.plugins.models.qwen2_5_vl import build_qwen2_5_vl

    register(
        "Qwen2_5_VLForConditionalGeneration",
        build_qwen2_5_vl,
        description="Qwen2.5-VL (windowed vision tower, M-RoPE)",
    )
