"""core/multimodal.py alone, engine-free: image hashes and pad ids, the spans a vocabulary
check reads as 0, pixel tensors, the encoder cache's LRU by bytes, and how a model's
registration tells whether (and how) it takes images (milliseconds; the vision tests run the
tiny VLMs)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.core.model_config import ModelConfig
from radixserve.core.multimodal import (
    EncoderCache,
    ImageInput,
    ImagePrompt,
    MultimodalInputs,
    accepts_images,
    checked_ids,
    image_hash,
    image_processor_for,
    pad_id,
    refuse_images_message,
)
from radixserve.core.plugins import PluginHost


def _image(offset: int, length: int, pixels: torch.Tensor | None = None) -> ImageInput:
    data = torch.zeros(1) if pixels is None else pixels
    return ImageInput(hash=7, pixels=data.numpy().tobytes(), shape=tuple(data.shape), grid=(1,),
                      offset=offset, length=length)  # fmt: skip


def test_image_hash_is_62_bits_of_the_bytes_sha256() -> None:
    digest = hashlib.sha256(b"png bytes").digest()
    assert image_hash(b"png bytes") == int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)
    assert image_hash(b"png bytes") != image_hash(b"png bytez")
    assert all(0 <= image_hash(bytes([i])) < 1 << 62 for i in range(64))
    assert max(image_hash(bytes([i])) for i in range(64)) >= 1 << 61  # the top bit is used
    assert any(image_hash(bytes([i])) % 2 for i in range(64))  # and the lowest


def test_pad_ids_sit_past_the_vocabulary() -> None:
    assert pad_id(5, 1000) == 1005
    assert pad_id((1 << 30) + 5, 1000) == 1005  # the span is 2**30 ids wide
    assert pad_id((1 << 30) - 1, 10) == 10 + (1 << 30) - 1
    assert pad_id(0, 384) == 384


def test_checked_ids_zero_the_image_spans_only() -> None:
    ids = [5, 900, 900, 900, 6, 901, 901, 7]
    mm = MultimodalInputs(images=[_image(1, 3), _image(5, 2)])
    assert checked_ids(ids, mm) == [5, 0, 0, 0, 6, 0, 0, 7]
    assert ids == [5, 900, 900, 900, 6, 901, 901, 7]  # the prompt itself is left alone
    assert checked_ids(ids, None) is ids
    assert mm.mrope is None and mm.mrope_delta == 0


def test_pixel_tensor_and_image_prompt() -> None:
    pixels = torch.arange(6, dtype=torch.float32).view(2, 3)
    image = _image(0, 1, pixels)
    out = image.pixel_tensor()
    assert out.dtype == torch.float32 and out.shape == (2, 3) and torch.equal(out, pixels)
    out[0, 0] = 9.0  # a copy: the request's bytes stay as sent
    assert image.pixel_tensor()[0, 0].item() == 0.0
    mm = MultimodalInputs(images=[image])
    prompt = ImagePrompt([1, 2, 3], mm)
    assert prompt == [1, 2, 3] and prompt.mm is mm and isinstance(prompt, list)


def test_encoder_cache_drops_the_least_recently_used_past_its_bytes() -> None:
    cache = EncoderCache(max_bytes=64)
    a, b, c = torch.zeros(4), torch.ones(4), torch.full((4,), 2.0)  # 16 bytes each
    assert cache.get(1) is None and cache.misses == 1 and cache.hits == 0
    cache.put(1, a)
    cache.put(2, b)
    assert cache.bytes == 32 and len(cache) == 2
    assert cache.get(1) is a and cache.hits == 1  # 1 is now the most recent
    cache.put(3, torch.zeros(8))  # 64 bytes in all: still fits
    assert len(cache) == 3 and cache.bytes == 64
    cache.put(4, c)  # 80 > 64: the LRU (2) goes
    assert cache.get(2) is None and cache.get(1) is a and cache.get(4) is c
    assert cache.bytes == 64 and len(cache) == 3
    cache.put(1, torch.zeros(2))  # replacing an entry counts its new size only
    assert cache.bytes == 56 and cache.get(1) is not a
    big = torch.zeros(100)
    cache.put(9, big)  # alone over the limit: kept, the others dropped
    assert len(cache) == 1 and cache.get(9) is big and cache.bytes == 400
    assert cache.hits == 5 and cache.misses == 2


def test_encoder_cache_counts_element_sizes() -> None:
    cache = EncoderCache(max_bytes=10)
    cache.put(1, torch.zeros(3, dtype=torch.float16))
    assert cache.bytes == 6
    cache.put(2, torch.zeros(2, dtype=torch.float16))
    assert cache.bytes == 10 and len(cache) == 2  # exactly at the limit: both kept
    cache.put(3, torch.zeros(1, dtype=torch.float16))
    assert cache.bytes == 6 and cache.get(1) is None


class _Images:
    placeholder = "<image>"

    def __init__(self, model_dir: str, config: ModelConfig) -> None:
        self.model_dir, self.config = model_dir, config


class _Vision:
    """Registers model ``TinyVision`` whose factory carries an ``image_processor``."""

    @hookimpl
    def register_models(self, register: Any) -> None:
        def build(*args: Any) -> None:
            return None

        build.image_processor = _Images  # type: ignore[attr-defined]
        register("TinyVision", build, description="test: takes images")


def _model_dir(tmp_path: Path, architecture: str) -> str:
    raw = dict(architectures=[architecture], hidden_size=32, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, vocab_size=64,
               intermediate_size=16, max_position_embeddings=64)  # fmt: skip
    folder = tmp_path / architecture
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


def test_the_registration_decides_whether_a_model_takes_images(tmp_path: Path) -> None:
    host = PluginHost(load_entry_points=False, extra_plugins=[("vision", _Vision())])
    vision_dir = _model_dir(tmp_path, "TinyVision")
    processor = image_processor_for(host, vision_dir)
    assert isinstance(processor, _Images)
    assert processor.model_dir == vision_dir and processor.config.architecture == "TinyVision"
    assert image_processor_for(host, _model_dir(tmp_path, "LlamaForCausalLM")) is None
    entry = host.registries["model"]._entries["TinyVision"]
    assert accepts_images(entry.factory) is True
    assert accepts_images(lambda: None) is False
    config = ModelConfig.from_dir(_model_dir(tmp_path, "Plain"))
    assert refuse_images_message(config) == (
        "the model Plain takes text only; this request sends images (image_url parts or "
        "image_data). Serve a vision-language model (see `radixserve plugins`: families "
        "marked 'images') to send images"
    )
