"""Stop conditions after each new token: stop token ids, EOS, stop strings, length limits.

Text for stop strings comes from the request's incremental detokenizer, so each token costs one
small decode, never a decode of the whole output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from radixserve.core.request import FinishReason, Req
from radixserve.core.tokenizer import IncrementalDetokenizer, Tokenizer

TopLogprobs = list[tuple[float, int]]


def streamable_text(text: str, stop: Sequence[str]) -> str:
    """The part of a running request's ``text`` that is safe to stream: a tail that could still
    grow into one of the ``stop`` strings is held back, because a matched stop string is cut
    from the output and streamed text is never taken back. A finished request's text is final.
    """
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[: len(text) - hold] if hold else text


class StopChecker:
    def __init__(
        self, tokenizer: Tokenizer, eos_token_ids: Sequence[int], max_context: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context

    def detokenizer(self, req: Req) -> IncrementalDetokenizer:
        if req.detok is None:
            req.detok = IncrementalDetokenizer(
                self.tokenizer, req.input_ids, req.sampling.skip_special_tokens
            )
        return req.detok

    def append(
        self, req: Req, token: int, logprob: float | None = None, top: TopLogprobs | None = None
    ) -> None:
        """Append one output token (with its logprobs when asked) and check the stop
        conditions."""
        req.output_ids.append(token)
        if req.sampling.logprobs:
            req.output_logprobs.append(logprob if logprob is not None else 0.0)
            req.output_top_logprobs.append(top or [])
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        self.check(req, token)

    def check(self, req: Req, token: int) -> None:
        """Update ``req``'s text with ``token`` and finish it if a stop condition holds."""
        params = req.sampling
        detok = self.detokenizer(req)
        if len(req.output_ids) >= params.min_new_tokens:
            if token in params.stop_token_ids or (
                not params.ignore_eos and token in self.eos_token_ids
            ):
                if params.no_stop_trim:
                    detok.add(token)
                detok.flush()
                req.finish(FinishReason("stop", matched=token))
                return
        delta = detok.add(token)
        if delta and params.stop and len(req.output_ids) >= params.min_new_tokens:
            if self._match_stop_string(req, detok, len(delta)):
                return
        n_out = len(req.output_ids)
        if n_out >= params.max_new_tokens or len(req.input_ids) + n_out >= self.max_context:
            detok.flush()
            req.finish(FinishReason("length", length=len(req.output_ids)))

    @staticmethod
    def _match_stop_string(req: Req, detok: IncrementalDetokenizer, delta_len: int) -> bool:
        text = detok.text
        longest = max(len(s) for s in req.sampling.stop)
        window_start = max(len(text) - delta_len - longest + 1, 0)
        best: tuple[int, str] | None = None
        for stop in req.sampling.stop:
            pos = text.find(stop, window_start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        if not req.sampling.no_stop_trim:
            detok.text = text[:pos]
        else:
            detok.text = text[: pos + len(stop)]
        req.finish(FinishReason("stop", matched=stop))
        return True
