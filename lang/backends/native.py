"""The frontend over SGLang's native ``/generate`` contract (PROTOCOL.md), transport-free.

``RuntimeEndpoint`` sends these request bodies over HTTP, ``EngineBackend`` hands them to an
in-process Engine; both get the same select() scoring and prefix caching from here.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

from radixserve.lang.backends.base import STREAM_DELTA_KEYS, Backend, BackendError, ProgramView
from radixserve.lang.choices import (
    ChoicesDecision,
    ChoicesMethod,
    mean_logprob,
    strip_unhealed_token,
)
from radixserve.lang.sampling import SamplingOptions

Body = dict[str, Any]


class NativeBackend(Backend):
    """Implement ``post`` (and ``post_stream``) for a transport; the rest is shared."""

    @abstractmethod
    def post(self, body: Body) -> Any:
        """Send one /generate request; return the decoded response (an object or a list)."""

    @abstractmethod
    def post_stream(self, body: Body) -> Iterator[dict[str, Any]]:
        """Send one streaming /generate request; yield each event (cumulative ``text``)."""

    # -- the Backend contract ------------------------------------------------------------------

    def cache_prefix(self, text: str) -> None:
        self.post({"text": text, "sampling_params": {"max_new_tokens": 0}})

    def generate(self, view: ProgramView, options: SamplingOptions) -> tuple[str, dict[str, Any]]:
        out = self.post(generate_body(view.text, options, view.images))
        return _item(out, "text"), out["meta_info"]

    def generate_stream(
        self, view: ProgramView, options: SamplingOptions
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        body = {**generate_body(view.text, options, view.images), "stream": True}
        seen = logprobs_seen = 0
        for event in self.post_stream(body):
            if "error" in event:
                raise BackendError(f"the stream failed: {_message(event['error'])}")
            text = _item(event, "text")
            piece = text[seen:]
            seen = len(text)
            meta = dict(event.get("meta_info", {}))
            length = meta.get("output_token_logprobs_length")
            if length is not None and len(meta.get("output_token_logprobs") or []) == length:
                # Cumulative lists (the server's default): keep each piece's own tokens only.
                for key in STREAM_DELTA_KEYS:
                    if key in meta:
                        meta[key] = meta[key][logprobs_seen:]
                logprobs_seen = length
            yield piece, meta

    def select(
        self, view: ProgramView, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        if temperature > 1e-5:
            raise ValueError(
                f"select() scores choices deterministically; temperature must be 0, got "
                f"{temperature}"
            )
        if not choices:
            raise ValueError("select() needs at least one choice")
        prefix = view.text
        # 1. Count (and cache) the prefix.
        images = _image_data(view.images)
        head = self.post({"text": prefix, "sampling_params": {"max_new_tokens": 0}, **images})
        prompt_tokens = int(head["meta_info"]["prompt_tokens"])
        # 2. Teacher-force every prefix + choice, scoring from one token before the prefix end.
        scored = self.post(
            {
                "text": [prefix + c for c in choices],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": max(prompt_tokens - 2, 0),
                **({"image_data": [images["image_data"]] * len(choices)} if images else {}),
            }
        )
        if not isinstance(scored, list) or len(scored) != len(choices):
            raise BackendError(f"expected {len(choices)} scored choices, got {_brief(scored)}")
        entries = [
            strip_unhealed_token(prefix, r["meta_info"]["input_token_logprobs"]) for r in scored
        ]
        outputs = [r["meta_info"].get("output_token_logprobs", []) for r in scored]
        unconditional = None
        # 3. Only for unconditional normalization: the same tokens with no prefix at all.
        if method.requires_unconditional_logprobs:
            alone = self.post(
                {
                    "input_ids": [[e[1] for e in row] for row in entries],
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                }
            )
            unconditional = [r["meta_info"]["input_token_logprobs"] for r in alone]
        return method(
            choices=choices,
            normalized_prompt_logprobs=[mean_logprob(row) for row in entries],
            input_token_logprobs=entries,
            output_token_logprobs=outputs,
            unconditional_token_logprobs=unconditional,
        )


def generate_body(text: str, options: SamplingOptions, images: tuple[str, ...] = ()) -> Body:
    return {
        "text": text,
        "sampling_params": options.resolved().native(),
        **options.logprob_request(),
        **_image_data(images),
    }


def _image_data(images: tuple[str, ...]) -> Body:
    """The native ``image_data`` field for a prompt's images (none: no field)."""
    return {"image_data": list(images)} if images else {}


def _item(obj: Any, key: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise BackendError(f"malformed /generate response (no {key!r}): {_brief(obj)}")
    return obj[key]


def _message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _brief(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) < 300 else text[:300] + "..."
