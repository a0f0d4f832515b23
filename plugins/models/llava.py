"""LLaVA (``LlavaForConditionalGeneration``, LLaVA-1.5 style): a CLIP vision tower whose
second-to-last layer's patch features (``vision_feature_layer``, CLS dropped with the
"default" strategy) go through a two-layer projector into a Llama decoder's input embeddings.

Tokenizer side, ``LlavaImages``: transformers' own image processor of the checkpoint (CLIP's:
resize, center crop, normalize) and the prompt's ``<image>`` token expanded to one token per
patch. Plain RoPE positions (no M-RoPE).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.multimodal import ImageInput, MultimodalInputs, image_hash, pad_id
from radixserve.core.parallel import SINGLE, TensorParallel
from radixserve.plugins.models.blocks import activation
from radixserve.plugins.models.decoder import DecoderForCausalLM
from radixserve.plugins.models.qwen2_vl import (
    MergesImageEmbeddings,
    placed_images,
    transformers_image_processor,
)


def _act(name: str) -> Any:
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    return activation(name)


class ClipAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class ClipMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        dim, eps = int(vc["hidden_size"]), float(vc.get("layer_norm_eps", 1e-5))
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(dim, eps), nn.LayerNorm(dim, eps)
        self.self_attn = ClipAttention(dim, int(vc["num_attention_heads"]))
        self.mlp = ClipMlp(dim, int(vc["intermediate_size"]), vc.get("hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        dim, patch = int(vc["hidden_size"]), int(vc["patch_size"])
        self.patch = patch
        positions = (int(vc["image_size"]) // patch) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(dim))
        self.patch_embedding = nn.Conv2d(int(vc.get("num_channels", 3)), dim, patch, patch,
                                         bias=False)  # fmt: skip
        self.position_embedding = nn.Embedding(positions, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat((cls, patches), dim=1) + self.position_embedding.weight


class ClipVision(nn.Module):
    """CLIP's vision transformer, parameters named as the checkpoint's ``vision_tower.*``."""

    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        dim, eps = int(vc["hidden_size"]), float(vc.get("layer_norm_eps", 1e-5))
        self.embeddings = ClipEmbeddings(vc)
        self.pre_layrnorm = nn.LayerNorm(dim, eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            ClipLayer(vc) for _ in range(int(vc["num_hidden_layers"]))
        )
        self.post_layernorm = nn.LayerNorm(dim, eps)  # loaded, unused (LLaVA reads a layer)

    def forward(self, pixels: torch.Tensor, layer: int) -> torch.Tensor:
        """The hidden states after ``layer`` (transformers' ``hidden_states[layer]``: 0 is
        the embeddings after pre_layrnorm, negative counts from the last layer's output)."""
        h = self.pre_layrnorm(self.embeddings(pixels))
        layers = self.encoder.layers
        stop = layer if layer >= 0 else len(layers) + 1 + layer
        for block in layers[:stop]:
            h = block(h)
        return h


class LlavaForConditionalGeneration(MergesImageEmbeddings, DecoderForCausalLM):
    """The Llama decoder with a CLIP vision tower and projector (images in)."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype,
                 device: str, group: TensorParallel = SINGLE) -> None:  # fmt: skip
        super().__init__(config, attention, dtype, device, group)
        raw = config.raw
        layer = raw.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ConfigError("vision_feature_layer as a list is not supported")
        self.feature_layer = layer
        self.keep_cls = raw.get("vision_feature_select_strategy", "default") == "full"
        vc, hidden = raw["vision_config"], config.hidden_size
        bias = bool(raw.get("multimodal_projector_bias", True))
        self.vision_tower = ClipVision(vc).to(device=device, dtype=dtype)
        projector = nn.Module()
        projector.linear_1 = nn.Linear(int(vc["hidden_size"]), hidden, bias=bias)
        projector.linear_2 = nn.Linear(hidden, hidden, bias=bias)
        self.multi_modal_projector = projector.to(device=device, dtype=dtype)
        self.projector_act = activation(raw.get("projector_hidden_act", "gelu"))

    @torch.inference_mode()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        device = self.embed_tokens.weight.device
        pixels = torch.stack([im.pixel_tensor() for im in images]).to(device)
        feats = self.vision_tower(pixels, self.feature_layer)
        if not self.keep_cls:
            feats = feats[:, 1:]
        p = self.multi_modal_projector
        out = p.linear_2(self.projector_act(p.linear_1(feats)))
        return list(out.unbind(0))

    def load_weights(self, weights: Any) -> None:
        """Checkpoint names as transformers 4 (``language_model.model.*``) or 5
        (``model.language_model.*``) saves them; ``vision_model.`` inside the tower dropped."""

        def rename(name: str) -> str:
            name = name.removeprefix("model.") if not name.startswith("model.layers") else name
            if name.startswith("language_model."):
                name = name.removeprefix("language_model.")
                return name if name.startswith(("model.", "lm_head")) else "model." + name
            return name.replace("vision_tower.vision_model.", "vision_tower.")

        super().load_weights((rename(n), t) for n, t in weights)


def build_llava(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> LlavaForConditionalGeneration:
    if config.raw.get("vision_config", {}).get("model_type", "clip_vision_model") != (
        "clip_vision_model"
    ):
        raise ConfigError("LLaVA here takes a CLIP vision tower (vision_config.model_type)")
    return LlavaForConditionalGeneration(config, attention, dtype, device, group)


class LlavaImages:
    """LLaVA's tokenizer-side image handling (core/multimodal.py, ``ImageProcessor``)."""

    placeholder = "<image>"

    def __init__(self, model_dir: str, config: ModelConfig) -> None:
        self.processor = transformers_image_processor(model_dir, "LLaVA")
        raw, vc = config.raw, config.raw["vision_config"]
        self.image_token = int(raw.get("image_token_id", raw.get("image_token_index", 32000)))
        self.vocab = config.vocab_size
        full = raw.get("vision_feature_select_strategy", "default") == "full"
        self.length = (int(vc["image_size"]) // int(vc["patch_size"])) ** 2 + int(full)

    def expand(
        self, input_ids: list[int], images: list[bytes]
    ) -> tuple[list[int], MultimodalInputs]:
        places, decoded = placed_images(input_ids, self.image_token, images)
        pixels = self.processor(images=decoded, return_tensors="pt")["pixel_values"].float()
        ids: list[int] = []
        items: list[ImageInput] = []
        last = 0
        for place, data, px in zip(places, images, pixels, strict=True):
            ids += input_ids[last:place]
            key = image_hash(data)
            px = px.contiguous()
            shape = tuple(px.shape)
            items.append(ImageInput(hash=key, pixels=px.numpy().tobytes(), shape=shape,
                                    grid=shape, offset=len(ids), length=self.length))  # fmt: skip
            ids += [pad_id(key, self.vocab)] * self.length
            last = place + 1
        ids += input_ids[last:]
        return ids, MultimodalInputs(images=items)


def _image_processor(model_dir: str, config: ModelConfig) -> LlavaImages:
    return LlavaImages(model_dir, config)


build_llava.image_processor = _image_processor  # type: ignore[attr-defined]
