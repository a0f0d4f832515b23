"""Images a request sends, as bytes: ``data:`` URLs, raw base64, local file paths, and (only
with ``--allow-remote-media``) http(s) URLs fetched with a size cap and a timeout. Every limit
(images per request, bytes and pixels per image) is a clear InvalidRequest (a 400)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

from radixserve.core.request import InvalidRequest


class MediaPolicy(NamedTuple):
    allow_remote: bool = False
    max_images: int = 8  # per request
    max_bytes: int = 20 << 20  # per image
    max_pixels: int = 4096 * 4096  # per image, before the processor resizes it
    timeout: float = 10.0  # seconds, for a remote fetch


def policy_of(config: Any) -> MediaPolicy:
    """The policy an EngineConfig (or ServerArgs) sets; defaults for fields it lacks."""
    d = MediaPolicy()
    return MediaPolicy(
        allow_remote=bool(getattr(config, "allow_remote_media", d.allow_remote)),
        max_images=int(getattr(config, "max_images_per_request", d.max_images)),
        max_bytes=int(getattr(config, "max_image_bytes", d.max_bytes)),
        max_pixels=int(getattr(config, "max_image_pixels", d.max_pixels)),
        timeout=float(getattr(config, "remote_media_timeout", d.timeout)),
    )


def load_images(refs: Any, policy: MediaPolicy) -> list[bytes]:
    """A request's images (one reference or a list) as checked bytes."""
    items = refs if isinstance(refs, list) else [refs]
    if len(items) > policy.max_images:
        raise InvalidRequest(
            f"the request has {len(items)} images; at most {policy.max_images} are allowed "
            "(--max-images-per-request)"
        )
    out = [image_bytes(ref, policy, i) for i, ref in enumerate(items)]
    for i, data in enumerate(out):
        check_image(data, policy, i)
    return out


def image_bytes(ref: Any, policy: MediaPolicy, index: int = 0) -> bytes:
    """One image reference as bytes (not yet checked as an image)."""
    if isinstance(ref, bytes | bytearray):
        return _capped(bytes(ref), policy, index)
    if isinstance(ref, dict):  # {"url": ...} as in OpenAI's image_url part
        ref = ref.get("url")
    if not isinstance(ref, str) or not ref:
        raise InvalidRequest(f"image {index} must be a data: URL, a file path or base64 text")
    if ref.startswith("data:"):
        head, sep, payload = ref.partition(",")
        if not sep or ";base64" not in head:
            raise InvalidRequest(f"image {index}: a data: URL must be base64 ('data:...;base64,')")
        return _capped(_b64(payload, index), policy, index)
    if ref.startswith(("http://", "https://")):
        return _fetch(ref, policy, index)
    if ref.startswith("file://"):
        ref = ref.removeprefix("file://")
    path = Path(ref)
    if len(ref) < 4096 and ("/" in ref or "." in ref[-6:]) and path.is_file():
        if path.stat().st_size > policy.max_bytes:
            raise _too_big(index, policy)
        return path.read_bytes()
    if len(ref) < 4096 and ("/" in ref or ref.startswith(".")):
        raise InvalidRequest(f"image {index}: no such file '{ref}'")
    return _capped(_b64(ref, index), policy, index)


def _b64(text: str, index: int) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"image {index} is neither a file path nor valid base64") from None


def _too_big(index: int, policy: MediaPolicy) -> InvalidRequest:
    return InvalidRequest(
        f"image {index} is larger than {policy.max_bytes} bytes (--max-image-bytes)"
    )


def _capped(data: bytes, policy: MediaPolicy, index: int) -> bytes:
    if len(data) > policy.max_bytes:
        raise _too_big(index, policy)
    return data


def _fetch(url: str, policy: MediaPolicy, index: int) -> bytes:
    if not policy.allow_remote:
        raise InvalidRequest(
            f"image {index} is a remote URL; the server fetches remote media only when started "
            "with --allow-remote-media (send a data: URL instead)"
        )
    try:
        with urllib.request.urlopen(url, timeout=policy.timeout) as resp:  # noqa: S310
            data = resp.read(policy.max_bytes + 1)
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"image {index}: fetching {url} failed: {e}") from None
    return _capped(data, policy, index)


def check_image(data: bytes, policy: MediaPolicy, index: int) -> None:
    """InvalidRequest when ``data`` is not an image PIL reads, or has too many pixels."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise InvalidRequest(
            "this server cannot read images: pillow is not installed "
            "(pip install 'radixserve[vision]')"
        ) from None

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            image.verify()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidRequest(f"image {index} is not a decodable image: {e}") from None
    if width * height > policy.max_pixels:
        raise InvalidRequest(
            f"image {index} has {width}x{height} pixels; at most {policy.max_pixels} are "
            "allowed (--max-image-pixels)"
        )


class ServerImages:
    """The server's side of a prompt's images: loaded, checked and preprocessed off the event
    loop (a worker thread), off the engine's step, by the model family's image processor."""

    def __init__(self, model_dir: str, policy: MediaPolicy | None = None) -> None:
        self.model_dir = model_dir
        self.policy = policy or MediaPolicy()
        self._processor: Any = None  # built at the first request with images; False: none

    def processor(self) -> Any:
        if self._processor is None:
            from radixserve.core.multimodal import image_processor_for
            from radixserve.core.plugins import default_host

            self._processor = image_processor_for(default_host(), self.model_dir) or False
        return self._processor

    @property
    def placeholder(self) -> str:
        """The text that stands for one image in a chat message."""
        proc = self.processor()
        return "" if proc is False else str(proc.placeholder)

    def refuse_if_text_only(self) -> None:
        if self.processor() is False:
            from radixserve.core.model_config import ModelConfig
            from radixserve.core.multimodal import refuse_images_message

            raise InvalidRequest(refuse_images_message(ModelConfig.from_dir(self.model_dir)))

    async def prompt(self, ids: list[int], refs: Any) -> list[int]:
        """``ids`` with ``refs``' images expanded (an ``ImagePrompt``); ``ids`` without any."""
        if refs is None or refs == []:
            return ids
        self.refuse_if_text_only()
        proc = self.processor()
        from radixserve.core.multimodal import ImagePrompt

        def work() -> list[int]:
            return ImagePrompt(*proc.expand(ids, load_images(refs, self.policy)))

        return await asyncio.to_thread(work)
