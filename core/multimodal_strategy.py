"""The vision encoder as a step strategy (core/interfaces.py): before each forward it finds the
image spans among the step's new tokens, encodes the images not in the encoder cache in one
batched call (the encoder's own step), and hands the model the rows to overwrite with image
embeddings and, for an M-RoPE family, every token's 3-D position (``ForwardBatch.mm``).

Requests with images are tracked from ``admit`` to their end; a text-only step sets nothing.
A chunk that ends inside an image takes the slice of the image's embeddings it covers; the
next chunk takes the rest (from the cache, or encoded again if the cache dropped it)."""

from __future__ import annotations

from typing import Any

import torch

from radixserve.core.config_checks import ConfigError
from radixserve.core.interfaces import StepStrategy
from radixserve.core.multimodal import EncoderCache, ImageInput, StepImages, checked_ids
from radixserve.core.request import InvalidRequest

#: encoder outputs kept by default (bytes)
DEFAULT_ENCODER_CACHE_BYTES = 256 << 20


class MultimodalStrategy(StepStrategy):
    def __init__(self, model: Any, device: str, cache_bytes: int) -> None:
        self.model = model
        self.device = device
        self.mrope = bool(getattr(model, "uses_mrope", False))
        self.cache = EncoderCache(cache_bytes)
        self.tracked: dict[str, Any] = {}  # rid -> request with images
        self.images_encoded = 0  # images the encoder ran on
        self.encoder_steps = 0  # batched encoder calls

    # -- the request lifecycle ---------------------------------------------------------------

    def admit(self, req: Any, compiling: bool) -> bool:
        if req.mm_inputs is not None:
            self.tracked[req.rid] = req
        return False

    def refused(self, req: Any, message: str) -> None:
        self.tracked.pop(req.rid, None)

    def ended(self, reqs: list[Any]) -> None:
        for req in reqs:
            if req.finished:
                self.tracked.pop(req.rid, None)

    def stats(self) -> dict[str, int]:
        return {
            "images_encoded": self.images_encoded,
            "encoder_steps": self.encoder_steps,
            "encoder_cache_hits": self.cache.hits,
            "encoder_cache_entries": len(self.cache),
            "encoder_cache_bytes": self.cache.bytes,
        }

    # -- the model runner --------------------------------------------------------------------

    def before_forward(self, batch: Any) -> None:
        by_row = {r.req_pool_idx: r for r in self.tracked.values() if r.req_pool_idx is not None}
        pool = batch.req_pool_indices.tolist() if by_row else []
        reqs = [by_row.get(p) for p in pool]
        if not any(r is not None for r in reqs):
            batch.mm = None
            return
        spans: list[tuple[int, ImageInput, int, int]] = []  # (row, image, lo, hi)
        positions: list[torch.Tensor] = []
        row = 0
        for req, n, seq_len in zip(reqs, batch.extend_lens, batch.seq_lens, strict=True):
            first = seq_len - n
            if self.mrope:
                positions.append(_mrope_positions(req, first, seq_len))
            if req is not None:
                for image in req.mm_inputs.images:
                    lo = max(first, image.offset)
                    hi = min(seq_len, image.offset + image.length)
                    if lo < hi:
                        spans.append(
                            (row + lo - first, image, lo - image.offset, hi - image.offset)
                        )
            row += n
        embeds = self._embeddings([s[1] for s in spans])
        rows = [torch.arange(r, r + hi - lo) for r, _, lo, hi in spans]
        parts = [embeds[img.hash][lo:hi] for _, img, lo, hi in spans]
        mrope = torch.cat(positions, dim=1).to(self.device) if positions else None
        if parts:
            batch.mm = StepImages(torch.cat(rows).to(self.device), torch.cat(parts), mrope)
        else:
            batch.mm = StepImages(torch.zeros(0, dtype=torch.int64, device=self.device),
                                  torch.zeros(0), mrope)  # fmt: skip

    def _embeddings(self, images: list[ImageInput]) -> dict[int, torch.Tensor]:
        """Each image's encoder output by hash: from the cache, the others encoded in one
        call."""
        found: dict[int, torch.Tensor] = {}
        missing: dict[int, ImageInput] = {}
        for image in images:
            if image.hash in found or image.hash in missing:
                continue
            cached = self.cache.get(image.hash)
            if cached is None:
                missing[image.hash] = image
            else:
                found[image.hash] = cached
        if missing:
            outputs = self.model.encode_images(list(missing.values()))
            self.encoder_steps += 1
            self.images_encoded += len(missing)
            for key, out in zip(missing, outputs, strict=True):
                self.cache.put(key, out)
                found[key] = out
        return found


def _mrope_positions(req: Any, first: int, end: int) -> torch.Tensor:
    """[3, end - first] M-RoPE positions of tokens first..end-1 of ``req`` (None: text only,
    every component the position itself)."""
    span = torch.arange(first, end, dtype=torch.int64)
    mm = None if req is None else req.mm_inputs
    if mm is None or mm.mrope is None:
        return span.expand(3, -1)
    table = getattr(req, "mrope_table", None)
    if table is None:
        table = req.mrope_table = torch.tensor(mm.mrope, dtype=torch.int64)
    prompt = table.shape[1]
    if first >= prompt:
        return (span + mm.mrope_delta).expand(3, -1)
    inside = table[:, first : min(end, prompt)]
    if end <= prompt:
        return inside
    after = torch.arange(prompt, end, dtype=torch.int64) + mm.mrope_delta
    return torch.cat((inside, after.expand(3, -1)), dim=1)


def build(core: Any) -> MultimodalStrategy | None:
    """The strategy of ``core`` (an EngineCore) when its model encodes images, else None."""
    runner = core.runner
    model = runner.model
    if not hasattr(model, "encode_images"):
        return None
    config = runner.config
    refused = (
        ("--tp-size > 1", config.tp_size > 1),
        ("--pp-size > 1", config.pp_size > 1),
        ("--speculative-algorithm", config.speculative_algorithm is not None),
        ("--disaggregation-mode", config.disaggregation_mode != "null"),
        ("--enable-lora", config.enable_lora),
    )
    for flag, on in refused:
        if on:
            raise ConfigError(
                f"a vision-language model ({type(model).__name__}) does not run with {flag} yet"
            )
    cache_bytes = getattr(runner.config, "mm_encoder_cache_mb", None)
    size = DEFAULT_ENCODER_CACHE_BYTES if cache_bytes is None else int(cache_bytes) << 20
    return MultimodalStrategy(model, runner.device, size)


def multimodal_of(core: Any) -> MultimodalStrategy | None:
    return next((s for s in core.strategies if isinstance(s, MultimodalStrategy)), None)


def text_ids(req: Any) -> list[int]:
    """``req``'s prompt with its image spans' pad ids as 0 (what vocabulary checks read);
    InvalidRequest for what a request with images cannot ask yet."""
    mm = req.mm_inputs
    if mm is None:
        return req.input_ids  # type: ignore[no-any-return]
    end = max(image.offset + image.length for image in mm.images)
    if 0 <= req.logprob_start_len < end:
        raise InvalidRequest(
            f"logprob_start_len={req.logprob_start_len} scores image tokens; prompt "
            f"logprobs start after the last image (logprob_start_len >= {end})"
        )
    if req.session_params is not None:
        raise InvalidRequest("a request with images cannot continue a session yet")
    return checked_ids(req.input_ids, mm)
