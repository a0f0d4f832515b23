"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): a ViT vision tower with 2-D rotary
attention and a 2x2 patch merger, feeding the Qwen2 decoder (``qwen2.py``) whose RoPE is
M-RoPE: each token has a (temporal, height, width) position, and the rotary frequencies are
split into three sections, each rotated by one of the three components (text tokens have
three equal components, so a text-only step is plain RoPE).

Tokenizer side, ``Qwen2VLImages``: transformers' own Qwen2-VL image processor (resize to
multiples of patch * merge within [min_pixels, max_pixels], normalize, patch) and the prompt's
``<|image_pad|>`` expanded to h * w / merge**2 tokens, with the M-RoPE positions of the prompt
computed as transformers' ``get_rope_index`` does.
"""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.multimodal import ImageInput, MultimodalInputs, image_hash, pad_id
from radixserve.core.parallel import SINGLE, TensorParallel
from radixserve.core.request import InvalidRequest
from radixserve.plugins.models.blocks import RotaryEmbedding, rope_inv_freq
from radixserve.plugins.models.decoder import DecoderForCausalLM, DecoderLayer

# ---- the vision tower (parameter names as the checkpoint's ``visual.*``) ----


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


#: the runs of a patch sequence that attend among themselves (a frame, a window), grouped by
#: length: (length, the indices of those runs' patches [count * length], on the device)
Segments = list[tuple[int, torch.Tensor]]


def segments(lengths: list[int], device: torch.device) -> Segments:
    """``lengths`` (consecutive runs) grouped by length, so that one attention call serves
    every run of a length (a 448x448 image's 16 windows: one call, not 16)."""
    starts: dict[int, list[int]] = {}
    pos = 0
    for n in lengths:
        starts.setdefault(n, []).append(pos)
        pos += n
    return [
        (n, (torch.tensor(s).unsqueeze(1) + torch.arange(n)).flatten().to(device))
        for n, s in starts.items()
    ]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """Attention within each consecutive run of ``length`` rows of q, k, v [N, heads, dim]."""
    heads, dim = q.shape[1:]
    q, k, v = (t.reshape(-1, length, heads, dim).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, heads, dim)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                spans: Segments) -> torch.Tensor:  # fmt: skip
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if len(spans) == 1:  # runs of one length cover the sequence in order
            out = _attend(q, k, v, spans[0][0])
        else:
            out = torch.empty_like(q)
            for length, index in spans:
                out[index] = _attend(q[index], k[index], v[index], length)
        return self.proj(out.reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_quick_gelu(self.fc1(x)))


class VisionBlock(nn.Module):
    """A pre-norm ViT block, ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``; the family
    picks the parts (Qwen2-VL: LayerNorms and a quick-GELU MLP)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, norm1: nn.Module,
                 norm2: nn.Module) -> None:  # fmt: skip
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                spans: Segments) -> torch.Tensor:  # fmt: skip
        x = x + self.attn(self.norm1(x), cos, sin, spans)
        return x + self.mlp(self.norm2(x))


def _layer_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6)


class PatchEmbed(nn.Module):
    """The Conv3d whose kernel is its stride: one product per flattened patch."""

    def __init__(self, shape: tuple[int, ...], dim: int) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(dim, *shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(x, weight.view(weight.shape[0], -1))


class PatchMerger(nn.Module):
    """``norm`` over each patch, then an MLP over each merge x merge block of them."""

    def __init__(self, dim: int, context: int, merge: int, norm: nn.Module) -> None:
        super().__init__()
        self.width = context * merge * merge
        self.ln_q = norm
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, dim))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchVisionTower(nn.Module):
    """What the Qwen2-VL and Qwen2.5-VL towers share: the patch embedding, the 2-D rotary
    table of the patches' (row, column) and the merger's block-major patch order. A family
    sets ``blocks`` and ``merger``."""

    blocks: nn.ModuleList
    merger: PatchMerger

    def __init__(self, vc: dict[str, Any], dim: int, heads: int) -> None:
        super().__init__()
        self.merge = int(vc.get("spatial_merge_size", 2))
        self.patch = int(vc.get("patch_size", 14))
        temporal, channels = int(vc.get("temporal_patch_size", 2)), int(vc.get("in_channels", 3))
        self.patch_embed = PatchEmbed((channels, temporal, self.patch, self.patch), dim)
        theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        half = dim // heads // 2
        self.register_buffer(
            "inv_freq", 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float) / half),
            persistent=False,
        )  # fmt: skip

    def positions(self, grids: list[tuple[int, ...]]) -> torch.Tensor:
        """[N, 2] (row, column) of every patch, in the merger's block-major order."""
        m, out = self.merge, []
        for t, h, w in grids:
            hpos = torch.arange(h).unsqueeze(1).expand(h, w)
            wpos = torch.arange(w).unsqueeze(0).expand(h, w)
            blocks = [
                p.reshape(h // m, m, w // m, m).transpose(1, 2).flatten() for p in (hpos, wpos)
            ]
            out.append(torch.stack(blocks, dim=-1).repeat(t, 1))
        return torch.cat(out)

    def rotary(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, 1, head_dim] of the patches' positions ``pos`` [N, 2]."""
        freqs = (pos.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [N, half]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()

    @staticmethod
    def frame_lengths(grids: list[tuple[int, ...]]) -> list[int]:
        """Patches per frame: the spans a full-attention block attends within."""
        return [h * w for t, h, w in grids for _ in range(t)]

    def embed_patches(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(pixels.to(self.patch_embed.proj.weight.dtype))


class VisionTower(PatchVisionTower):
    """Qwen2-VL's: every block attends over its whole frame."""

    def __init__(self, vc: dict[str, Any]) -> None:
        dim, heads = int(vc["embed_dim"]), int(vc["num_heads"])
        if vc.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise ConfigError(f"vision_config.hidden_act '{vc['hidden_act']}' is not supported")
        super().__init__(vc, dim, heads)
        hidden = int(dim * float(vc.get("mlp_ratio", 4)))
        self.blocks = nn.ModuleList(
            VisionBlock(
                VisionAttention(dim, heads),
                VisionMlp(dim, hidden),
                _layer_norm(dim),
                _layer_norm(dim),
            )
            for _ in range(int(vc["depth"]))
        )
        self.merger = PatchMerger(int(vc["hidden_size"]), dim, self.merge, _layer_norm(dim))

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, ...]]) -> torch.Tensor:
        x = self.embed_patches(pixels)
        cos, sin = self.rotary(self.positions(grids).to(x.device))
        frames = segments(self.frame_lengths(grids), x.device)
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)


# ---- M-RoPE ----


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose step may set per-token 3-D positions (``set_positions``)."""

    def __init__(self, config: ModelConfig, device: str, dtype: torch.dtype,
                 section: list[int]) -> None:  # fmt: skip
        super().__init__(config, device, dtype)
        self.section = section
        self.inv_freq = rope_inv_freq(config).to(device)
        self.dtype = dtype
        self._mrope: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_positions(self, mrope: torch.Tensor | None) -> None:
        if mrope is None:
            self._mrope = None
            return
        freqs = mrope.unsqueeze(-1).float() * self.inv_freq  # [3, T, head_dim / 2]
        chunks = freqs.split(self.section, dim=-1)
        f = torch.cat([c[i % 3] for i, c in enumerate(chunks)], dim=-1)
        cos, sin = f.cos().to(self.dtype), f.sin().to(self.dtype)
        self._mrope = (
            torch.cat((cos, cos), -1).unsqueeze(1),
            torch.cat((-sin, sin), -1).unsqueeze(1),
        )

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._mrope is None:
            return super().apply(x, positions)
        cos, sin = self._mrope
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * sin


# ---- the model ----


class Qwen2VLLayer(DecoderLayer):
    def attention_biases(self, raw: dict[str, Any]) -> tuple[bool, bool]:
        return True, False  # Qwen2's: q/k/v carry a bias, o_proj does not


class MergesImageEmbeddings:
    """A decoder whose input embeddings take the encoder's output at the image spans' rows
    (``_mm``, set for each forward from ``ForwardBatch.mm``); a span's pad ids, which lie past
    the vocabulary (core/multimodal.py), are clamped into it before the lookup."""

    _mm: Any = None
    embed_tokens: nn.Embedding
    config: ModelConfig

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids.clamp(max=self.config.vocab_size - 1))
        mm = self._mm
        if mm is not None and mm.rows.numel():
            h = h.clone()
            h[mm.rows] = mm.embeds.to(h.dtype)
        return h

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._mm = batch.mm
        try:
            return super().forward(batch)  # type: ignore[misc]
        finally:
            self._mm = None


class Qwen2VLForConditionalGeneration(MergesImageEmbeddings, DecoderForCausalLM):
    """Registered by ``qwen2.py`` (the Qwen2 plugin)."""

    layer_cls = Qwen2VLLayer
    uses_mrope = True
    #: the vision tower's class, built from ``vision_config``
    vision_cls: type[nn.Module] = VisionTower

    def __init__(self, config: ModelConfig, attention: AttentionBackend, dtype: torch.dtype,
                 device: str, group: TensorParallel = SINGLE) -> None:  # fmt: skip
        super().__init__(config, attention, dtype, device, group)
        raw = config.raw
        section = list(_rope_params(raw).get("mrope_section") or [16, 24, 24])
        if sum(section) * 2 != config.head_dim:
            raise ConfigError(f"mrope_section {section} does not cover head_dim {config.head_dim}")
        self.rope = MRotaryEmbedding(config, device, dtype, section)
        self.rope.fused = None
        for layer in self.layers:
            layer.rope_in_attention = False
        self.visual = self.vision_cls(raw["vision_config"]).to(device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.rope.set_positions(None if batch.mm is None else batch.mm.mrope)
        try:
            return super().forward(batch)
        finally:
            self.rope.set_positions(None)

    @torch.inference_mode()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        device = self.embed_tokens.weight.device
        pixels = torch.cat([im.pixel_tensor() for im in images]).to(device)
        out = self.visual(pixels, [tuple(im.grid) for im in images])
        return list(out.split([im.length for im in images]))

    def load_weights(self, weights: Any) -> None:
        """The checkpoint's ``visual.*`` load as named (the vision tower's parameters are named
        like them); the language model's under ``model.`` or ``model.language_model.``."""
        renamed = (
            (name.replace("model.language_model.", "model.").replace("model.visual.", "visual."), t)
            for name, t in weights
        )
        super().load_weights(renamed)


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})


def mrope_as_default(config: ModelConfig) -> ModelConfig:
    """``config`` with an "mrope" rope type read as the default one: M-RoPE is the default
    RoPE's frequencies split into sections (``MRotaryEmbedding``)."""
    raw = dict(config.raw)
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) == "mrope":
            raw[key] = {**params, "rope_type": "default", "type": "default"}
    return replace(config, raw=raw)


def build_qwen2_vl(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> Qwen2VLForConditionalGeneration:
    return Qwen2VLForConditionalGeneration(
        mrope_as_default(config), attention, dtype, device, group
    )


# ---- the tokenizer side ----


def placed_images(
    input_ids: list[int], image_token: int, images: list[bytes]
) -> tuple[list[int], list[Any]]:
    """The positions of a prompt's image placeholders and its images decoded, one per
    placeholder (a count that differs is the request's error)."""
    places = [i for i, t in enumerate(input_ids) if t == image_token]
    if len(places) != len(images):
        raise InvalidRequest(
            f"the prompt has {len(places)} image placeholders for {len(images)} images"
        )
    return places, [decode_image(data, i) for i, data in enumerate(images)]


def decode_image(data: bytes, index: int) -> Any:
    """A PIL image in RGB; InvalidRequest naming the image when its bytes are not one."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise InvalidRequest(
            "images need pillow, which is not installed (pip install 'radixserve[vision]')"
        ) from None

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidRequest(f"image {index} is not a decodable image: {e}") from None


def transformers_image_processor(model_dir: str, family: str) -> Any:
    """The family's own image processor from transformers, the reference for preprocessing."""
    try:
        from transformers import AutoImageProcessor
    except ImportError:
        raise ConfigError(f"{family}'s image preprocessing is transformers' own; install it "
                          "(pip install 'radixserve[vision]')") from None  # fmt: skip
    return AutoImageProcessor.from_pretrained(model_dir)


class Qwen2VLImages:
    """Qwen2-VL's tokenizer-side image handling (core/multimodal.py, ``ImageProcessor``)."""

    def __init__(self, model_dir: str, config: ModelConfig) -> None:
        self.processor = transformers_image_processor(model_dir, "Qwen2-VL")
        raw = config.raw
        self.image_token = int(raw["image_token_id"])
        self.vocab = config.vocab_size
        self.merge = int(raw["vision_config"].get("spatial_merge_size", 2))
        #: what stands for one image in a chat message's text (as the family's template has it)
        self.placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def expand(
        self, input_ids: list[int], images: list[bytes]
    ) -> tuple[list[int], MultimodalInputs]:
        places, decoded = placed_images(input_ids, self.image_token, images)
        out = self.processor(images=decoded, return_tensors="pt")
        pixels = out["pixel_values"].float().contiguous()
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        rows = pixels.split([t * h * w for t, h, w in grids])
        ids: list[int] = []
        pos: list[list[int]] = [[], [], []]
        items: list[ImageInput] = []
        cur, last = 0, 0
        for place, data, grid, px in zip(places, images, grids, rows, strict=True):
            cur = self._text(ids, pos, input_ids[last:place], cur)
            t, h, w = grid[0], grid[1] // self.merge, grid[2] // self.merge
            key = image_hash(data)
            items.append(ImageInput(hash=key, pixels=px.numpy().tobytes(), shape=tuple(px.shape),
                                    grid=grid, offset=len(ids), length=t * h * w))  # fmt: skip
            ids += [pad_id(key, self.vocab)] * (t * h * w)
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                        indexing="ij")  # fmt: skip
            for axis, grid_pos in enumerate((tt, hh, ww)):
                pos[axis] += (grid_pos.flatten() + cur).tolist()
            cur += max(h, w)
            last = place + 1
        cur = self._text(ids, pos, input_ids[last:], cur)
        delta = cur - len(ids)
        return ids, MultimodalInputs(images=items, mrope=pos, mrope_delta=delta)

    @staticmethod
    def _text(ids: list[int], pos: list[list[int]], text: list[int], cur: int) -> int:
        ids += text
        for axis in pos:
            axis += range(cur, cur + len(text))
        return cur + len(text)


def image_processor(model_dir: str, config: ModelConfig) -> Qwen2VLImages:
    """The tokenizer side's image handling (Qwen2-VL's and Qwen2.5-VL's)."""
    return Qwen2VLImages(model_dir, config)


build_qwen2_vl.image_processor = image_processor  # type: ignore[attr-defined]
