"""Idefics3 / SmolVLM (``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``:
the same architecture and weight names): a SigLIP-style vision transformer whose position
embeddings stretch to any patch grid (NaViT-style fractional buckets), a connector that
pixel-shuffles the patch features by ``scale_factor`` (s x s neighbours into one token) and
projects them linearly, and the Llama decoder (``decoder.py``'s skeleton, as Llama uses it).

Tokenizer side, ``Idefics3Images``: transformers' own image processor of the checkpoint splits
each image into tiles of ``max_image_size`` (rows x cols, after resizing its longest edge to
``size``) plus the whole image shrunk to one tile (the global image); the prompt's ``<image>``
becomes the text transformers' processor writes for it (``<fake_token_around_image>``,
``<row_i_col_j>`` before each tile, a newline after each row, ``<global-img>`` before the global
image, ``image_seq_len`` ``<image>`` tokens per tile), tokenized by the model's tokenizer.

Each tile is one ``ImageInput`` (core/multimodal.py) over its run of ``<image>`` tokens, keyed
by a hash derived from the image's hash and the tile's index: the radix cache sees every tile
of the same image as the same tokens (the text between the tiles is the same for the same
image), the encoder cache keeps tiles, and a prefill chunk may end inside any tile.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.multimodal import ImageInput, MultimodalInputs, image_hash, pad_id
from radixserve.core.parallel import SINGLE, TensorParallel
from radixserve.core.request import InvalidRequest
from radixserve.plugins.models.decoder import DecoderForCausalLM
from radixserve.plugins.models.llava import ClipLayer
from radixserve.plugins.models.qwen2_vl import (
    MergesImageEmbeddings,
    placed_images,
    transformers_image_processor,
)

ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")

#: transformers' Idefics3VisionConfig defaults (a saved config may leave them out)
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
}  # fmt: skip


# ---- the vision tower (parameter names as the checkpoint's ``model.vision_model.*``) ----


def position_ids(rows: int, cols: int, side: int, device: Any) -> torch.Tensor:
    """[rows * cols] position-embedding indices of a tile of rows x cols patches: each patch's
    fractional coordinate bucketed into the ``side`` x ``side`` trained grid (transformers'
    Idefics3VisionEmbeddings with the tile's patch attention mask, computed the same way)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
    coords = []
    for n in (rows, cols):
        step = 1.0 / torch.tensor([n], device=device)
        frac = torch.arange(n, device=device, dtype=torch.float32)[None, :] * step[:, None]
        coords.append(torch.bucketize(frac.clamp(max=1.0 - 1e-6), boundaries, right=True)[0])
    return (coords[0][:, None] * side + coords[1][None, :]).flatten()


class SiglipEmbeddings(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        dim, self.patch = int(vc["hidden_size"]), int(vc["patch_size"])
        self.side = int(vc["image_size"]) // self.patch
        self.patch_embedding = nn.Conv2d(int(vc["num_channels"]), dim, self.patch, self.patch)
        self.position_embedding = nn.Embedding(self.side**2, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, rows * cols, dim] for B tiles of the same size."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        rows, cols = patches.shape[-2:]
        pos = position_ids(rows, cols, self.side, pixels.device)
        return patches.flatten(2).transpose(1, 2) + self.position_embedding(pos)


class SiglipEncoder(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(vc) for _ in range(int(vc["num_hidden_layers"])))


class SiglipVision(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(vc)
        self.encoder = SiglipEncoder(vc)
        dim = int(vc["hidden_size"])
        self.post_layernorm = nn.LayerNorm(dim, eps=float(vc["layer_norm_eps"]))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(pixels)
        for block in self.encoder.layers:
            h = block(h)
        return self.post_layernorm(h)


class Projection(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, hidden, bias=False)


class Connector(nn.Module):
    """The checkpoint's ``connector.modality_projection.proj`` (the pixel shuffle before it:
    ``pixel_shuffle``)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.modality_projection = Projection(width, hidden)


def pixel_shuffle(x: torch.Tensor, rows: int, cols: int, s: int) -> torch.Tensor:
    """[B, rows * cols, d] -> [B, rows * cols / s**2, d * s**2]: each s x s block of patches
    becomes one token (transformers' Idefics3Connector.pixel_shuffle, square or not)."""
    b, _, d = x.shape
    x = x.view(b, rows, cols // s, d * s).permute(0, 2, 1, 3)
    x = x.reshape(b, cols // s, rows // s, d * s * s).permute(0, 2, 1, 3)
    return x.reshape(b, (rows // s) * (cols // s), d * s * s)


class Idefics3ForConditionalGeneration(MergesImageEmbeddings, DecoderForCausalLM):
    """The Llama decoder (``decoder.py``'s skeleton, as ``llama.py`` builds it) with a SigLIP
    vision tower and the pixel-shuffle connector."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype,
                 device: str, group: TensorParallel = SINGLE) -> None:  # fmt: skip
        super().__init__(config, attention, dtype, device, group)
        vc = vision_config(config)
        self.scale = int(config.raw.get("scale_factor", 2))
        self.patch = int(vc["patch_size"])
        self.vision_model = SiglipVision(vc).to(device=device, dtype=dtype)
        self.connector = Connector(int(vc["hidden_size"]) * self.scale**2, config.hidden_size)
        self.connector.to(device=device, dtype=dtype)

    @torch.inference_mode()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each tile's embeddings [length, hidden]: one encoder call per tile size (every tile
        of a checkpoint's processor has the same size, so one call)."""
        device = self.embed_tokens.weight.device
        out: list[torch.Tensor | None] = [None] * len(images)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            by_shape.setdefault(tuple(image.shape), []).append(i)
        for shape, idx in by_shape.items():
            pixels = torch.stack([images[i].pixel_tensor() for i in idx]).to(device)
            feats = self.vision_model(pixels)
            rows, cols = shape[1] // self.patch, shape[2] // self.patch
            feats = pixel_shuffle(feats, rows, cols, self.scale)
            for i, f in zip(idx, self.connector.modality_projection.proj(feats), strict=True):
                out[i] = f
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Any) -> None:
        """``model.text_model.*`` is the decoder's ``model.*``; ``model.vision_model.*`` and
        ``model.connector.*`` load as named."""
        super().load_weights((n.replace("model.text_model.", "model."), t) for n, t in weights)


def vision_config(config: ModelConfig) -> dict[str, Any]:
    return {**VISION_DEFAULTS, **config.raw.get("vision_config", {})}


def build_idefics3(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> Idefics3ForConditionalGeneration:
    vc = vision_config(config)
    side = int(vc["image_size"]) // int(vc["patch_size"])
    scale = int(config.raw.get("scale_factor", 2))
    if side % scale:
        raise ConfigError(f"scale_factor {scale} does not divide the {side} patches of a tile side")
    return Idefics3ForConditionalGeneration(config, attention, dtype, device, group)


# ---- the tokenizer side ----


class Idefics3Images:
    """Idefics3's tokenizer-side image handling (core/multimodal.py, ``ImageProcessor``)."""

    placeholder = "<image>"

    def __init__(self, model_dir: str, config: ModelConfig) -> None:
        from radixserve.core.tokenizer import Tokenizer

        self.processor = transformers_image_processor(model_dir, "Idefics3")
        self.tokenizer = Tokenizer(model_dir)
        raw, vc = config.raw, vision_config(config)
        self.image_token = int(raw.get("image_token_id", 128257))
        self.vocab = config.vocab_size
        self.patch, self.scale = int(vc["patch_size"]), int(raw.get("scale_factor", 2))
        side = int(vc["image_size"]) // self.patch
        self.seq_len = side * side // self.scale**2
        names = _token_names(model_dir)
        self.fake = names.get("fake_image_token", "<fake_token_around_image>")
        self.glob = names.get("global_image_token", "<global-img>")
        self.image = names.get("image_token", "<image>")
        self._layouts: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def layout(self, rows: int, cols: int) -> tuple[list[int], list[int]]:
        """The token ids transformers' processor writes for an image of rows x cols tiles
        (0 x 0: not split) and where each tile's run of ``<image>`` tokens starts."""
        key = (rows, cols)
        if key not in self._layouts:
            tile = self.image * self.seq_len
            text = "".join(
                "".join(f"{self.fake}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
                for r in range(rows)
            )
            text += ("\n" if rows else "") + f"{self.fake}{self.glob}{tile}{self.fake}"
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            starts = [i for i, t in enumerate(ids)
                      if t == self.image_token and (i == 0 or ids[i - 1] != t)]  # fmt: skip
            runs = sum(t == self.image_token for t in ids)
            if len(starts) != rows * cols + 1 or runs != len(starts) * self.seq_len:
                raise ConfigError(f"the tokenizer does not keep '{self.image}' one token")
            self._layouts[key] = (ids, starts)
        return self._layouts[key]

    def expand(
        self, input_ids: list[int], images: list[bytes]
    ) -> tuple[list[int], MultimodalInputs]:
        places, decoded = placed_images(input_ids, self.image_token, images)
        out = self.processor(images=[decoded], return_tensors="pt", return_row_col_info=True)
        pixels = out["pixel_values"][0].float()
        masks = out.get("pixel_attention_mask")  # None: the processor pads nothing
        masks = torch.ones_like(pixels[:, 0]) if masks is None else masks[0]
        tiles = iter(zip(pixels, masks, strict=True))
        ids: list[int] = []
        items: list[ImageInput] = []
        last = 0
        for k, (place, data) in enumerate(zip(places, images, strict=True)):
            ids += input_ids[last:place]
            layout, starts = self.layout(int(out["rows"][0][k]), int(out["cols"][0][k]))
            base, key = len(ids), image_hash(data)
            ids += layout
            for j, start in enumerate(starts):
                px = self._crop(*next(tiles))
                h, w = px.shape[1] // self.patch, px.shape[2] // self.patch
                length = (h // self.scale) * (w // self.scale)
                if length != self.seq_len:
                    raise InvalidRequest(f"image {k}: a tile of {h}x{w} patches does not give "
                                         f"{self.seq_len} image tokens")  # fmt: skip
                tile_key = tile_hash(key, j)
                items.append(ImageInput(hash=tile_key, pixels=px.numpy().tobytes(),
                                        shape=tuple(px.shape), grid=(h, w),
                                        offset=base + start, length=length))  # fmt: skip
                ids[base + start : base + start + length] = [pad_id(tile_key, self.vocab)] * length
            last = place + 1
        ids += input_ids[last:]
        return ids, MultimodalInputs(images=items)

    def _crop(self, px: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A tile without the padding transformers' processor adds up to the batch's largest
        tile (whole patches kept, as its patch attention mask does)."""
        h, w = int(mask[:, 0].sum()), int(mask[0].sum())
        p = self.patch
        return px[:, : -(-h // p) * p, : -(-w // p) * p].contiguous()


def tile_hash(image_key: int, index: int) -> int:
    """The hash standing for tile ``index`` of the image whose hash is ``image_key``."""
    return image_hash(image_key.to_bytes(8, "little") + index.to_bytes(4, "little"))


def _token_names(model_dir: str) -> dict[str, str]:
    """The image tokens ``tokenizer_config.json`` names (SmolVLM's processor reads them there;
    Idefics3's uses the defaults), as text."""
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    out = {}
    for key in ("fake_image_token", "global_image_token", "image_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def _image_processor(model_dir: str, config: ModelConfig) -> Idefics3Images:
    return Idefics3Images(model_dir, config)


build_idefics3.image_processor = _image_processor  # type: ignore[attr-defined]
