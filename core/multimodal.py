"""Images in, text out: the contract between the tokenizer side, the engine and a
vision-language model plugin.

Tokenizer side (off the engine's step): an ``ImageProcessor`` (the family's, found through the
model registration's factory attribute ``image_processor``) decodes each image, preprocesses it
as transformers' processor of the family does, expands the prompt's image placeholder token
into the image's span of tokens and returns ``MultimodalInputs``. The span's token ids are
replaced by a pad id derived from the image's content hash (``pad_id``, >= the vocabulary size):
the radix cache keys on token ids, so the same image is a prefix hit and a different one never
is; the model never embeds those ids (their rows take the vision encoder's output).

Engine side: ``core/multimodal_strategy.py`` runs the encoder for the step's new images (one
batched call, outputs cached by hash in ``EncoderCache``) and hands the model, through
``ForwardBatch.mm``, the rows to overwrite and (M-RoPE families) each token's 3-D position.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import msgspec

if TYPE_CHECKING:  # torch stays unimported for `radixserve plugins` and --help
    import torch

#: pad ids live in [vocab, vocab + _PAD_SPAN): never a real token
_PAD_SPAN = 1 << 30


class ImageInput(msgspec.Struct, kw_only=True):
    """One preprocessed image of a request."""

    hash: int  # of the image's bytes (``image_hash``)
    pixels: bytes  # the processor's pixel values, float32, row-major
    shape: tuple[int, ...]  # their shape
    grid: tuple[int, ...]  # the family's patch grid (Qwen2-VL: t, h, w)
    offset: int  # position of the span's first token in the prompt
    length: int  # tokens in the span

    def pixel_tensor(self) -> torch.Tensor:
        import torch

        flat = torch.frombuffer(bytearray(self.pixels), dtype=torch.float32)
        return flat.view(*self.shape)


class MultimodalInputs(msgspec.Struct, kw_only=True):
    """A request's images, in prompt order, and (M-RoPE families) the prompt's 3-D positions
    with the offset of positions after the prompt (a decode at ``i`` is at ``i + delta``)."""

    images: list[ImageInput]
    mrope: list[list[int]] | None = None
    mrope_delta: int = 0


class ImagePrompt(list):  # type: ignore[type-arg]
    """A prompt's token ids (image spans expanded to pad ids) carrying its images: how a prompt
    with images travels the server's prompt paths, which take lists of ids."""

    mm: MultimodalInputs

    def __init__(self, ids: list[int], mm: MultimodalInputs) -> None:
        super().__init__(ids)
        self.mm = mm


def checked_ids(ids: list[int], mm: MultimodalInputs | None) -> list[int]:
    """``ids`` with the image spans of ``mm`` as 0: what vocabulary checks read."""
    if mm is None:
        return ids
    out = list(ids)
    for image in mm.images:
        out[image.offset : image.offset + image.length] = [0] * image.length
    return out


class StepImages(NamedTuple):
    """What the model needs of one step's images (``ForwardBatch.mm``)."""

    rows: torch.Tensor  # [R] rows of the step's flattened tokens that take image embeddings
    embeds: torch.Tensor  # [R, hidden] their embeddings, in row order
    mrope: torch.Tensor | None  # [3, T] each token's M-RoPE position, or None


class ImageProcessor(Protocol):
    """A family's tokenizer-side image handling."""

    placeholder: str  # the text standing for one image in a chat message

    def expand(
        self, input_ids: list[int], images: list[bytes]
    ) -> tuple[list[int], MultimodalInputs]:
        """The prompt with each placeholder expanded to its image's span (pad ids), and the
        images' inputs. InvalidRequest for a bad image or a placeholder count mismatch."""
        ...


class MultimodalModel(Protocol):
    """What a vision-language model plugin adds to ``CausalLM``."""

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's embeddings [length, hidden], one batched encoder call."""
        ...


def image_hash(data: bytes) -> int:
    """A 62-bit content hash of an image's bytes."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & ((1 << 62) - 1)


def pad_id(hash_: int, vocab_size: int) -> int:
    """The token id that stands for every token of an image span in the radix cache."""
    return vocab_size + hash_ % _PAD_SPAN


def image_processor_for(host: Any, model_dir: str) -> ImageProcessor | None:
    """The tokenizer-side image processor of the model in ``model_dir``, None for a text-only
    family (its registration's factory has no ``image_processor``)."""
    from radixserve.core.model_config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    entry = host.registries["model"]._entries.get(config.architecture)
    make = getattr(getattr(entry, "factory", None), "image_processor", None)
    return None if make is None else make(model_dir, config)


def refuse_images_message(config: Any) -> str:
    """Why a text-only model refuses a request with images (a 400)."""
    return (
        f"the model {config.architecture} takes text only; this request sends images "
        "(image_url parts or image_data). Serve a vision-language model "
        "(see `radixserve plugins`: families marked 'images') to send images"
    )


def accepts_images(factory: Any) -> bool:
    """Whether a model registration's factory serves images (``radixserve plugins``)."""
    return getattr(factory, "image_processor", None) is not None


class EncoderCache:
    """Vision-encoder outputs by image hash, least recently used dropped past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: int) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: int, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        self._entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()

    def __len__(self) -> int:
        return len(self._entries)
