"""ServerReq: the server process's view of one request, the cumulative outputs and timing the
TokenizerManager (``tokenizer_manager.py``) updates from the engine's per-step deltas and the
HTTP handlers read once its ``event`` is set.
"""

from __future__ import annotations

import asyncio
import time

from radixserve.core.request import FinishReason, SamplingParams
from radixserve.core.stop import streamable_text


class ServerReq:
    """The server's view of one request: cumulative outputs and timing."""

    __slots__ = (
        "rid", "prompt_ids", "sampling", "event", "output_ids", "text", "logprobs",
        "top_logprobs", "cached_tokens", "context_tokens", "finish", "error_status", "created",
        "logprob_start_len", "input_logprobs", "input_top_logprobs",
        "first_token_time", "last_token_time", "finish_time", "timer", "spec_verify_ct",
        "spec_accepted_tokens", "streaming", "embedding", "label_logprobs", "spec_draft_tokens",
        "custom_labels",
    )  # fmt: skip

    def __init__(
        self, rid: str, prompt_ids: list[int], sampling: SamplingParams, event: asyncio.Event
    ) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.event = event  # shared by all requests of one HTTP call
        self.output_ids: list[int] = []
        self.text = ""
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.logprob_start_len = -1
        self.input_logprobs: list[float] = []
        self.input_top_logprobs: list[list[tuple[float, int]]] = []
        self.cached_tokens = 0
        self.context_tokens = 0  # a session's context the engine put before prompt_ids
        self.spec_verify_ct = 0  # speculation so far (spec_meta.py)
        self.spec_accepted_tokens = 0
        self.spec_draft_tokens = 0
        self.custom_labels: dict[str, str] | None = None  # the client's (metrics groups)
        # prefill-only results (serving_embedding.py, serving_score.py)
        self.embedding: list[float] | None = None
        self.label_logprobs: list[float] | None = None
        self.finish: FinishReason | None = None
        self.error_status = 0
        self.created = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.timer: asyncio.TimerHandle | None = None  # --request-timeout
        self.streaming = False  # its handler streams it (metrics label is_streaming)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def failed(self) -> bool:
        """Ended by the engine's refusal or failure (not by the client's own abort)."""
        return self.error_status != 0

    def visible_text(self) -> str:
        """The text safe to stream (see ``streamable_text``)."""
        return self.text if self.finished else streamable_text(self.text, self.sampling.stop)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.created
