"""Qwen3 (``Qwen3ForCausalLM``): the Llama decoder with a per-head RMSNorm of q and k (over
head_dim, before RoPE) and an explicit ``head_dim``. The skeleton's ``qk_norm`` switch does it.
"""

from __future__ import annotations

import torch

from radixserve.core.config import ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.parallel import SINGLE, TensorParallel
from radixserve.plugins.models.decoder import DecoderForCausalLM, DecoderLayer


class Qwen3Layer(DecoderLayer):
    qk_norm = True


class Qwen3ForCausalLM(DecoderForCausalLM):
    layer_cls = Qwen3Layer


def build_qwen3(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(config, attention, dtype, device, group)


@hookimpl
def register_models(register) -> None:  # type: ignore[no-untyped-def]
    register("Qwen3ForCausalLM", build_qwen3, description="Qwen3 dense (q/k RMSNorm)")
