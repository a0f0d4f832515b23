"""Admission control: the per-server request limits and the refusal a full queue gives.

Every limit is a server flag (see ``--help``); a request beyond a size limit is a 400 naming
the field, and one that arrives while the queue is full or the server is draining is a 503 with
``Retry-After``, so no client can make the server hold unbounded work. A call that could never
fit (more generations at once than the server ever holds) is a 400, not a 503: retrying it
cannot succeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.core.request import InvalidRequest, SamplingParams

RETRY_AFTER_S = 1


class Overloaded(Exception):
    """The server refuses new work for now (queue full, or shutting down): a 503."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Limits:
    """What one server admits. ``max_live`` counts running plus queued requests."""

    max_queued_requests: int = 1024
    max_running_requests: int = 64
    request_timeout: float | None = None
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_top_logprobs: int = 100
    # characters tokenized for one request, all its prompts together: a body cannot carry more
    # (the request-body limit), but some fields are copied into every prompt (/v1/score's
    # query, a completion's suffix), so they are checked against it before they are built
    max_batch_chars: int = 32 << 20

    @property
    def max_live(self) -> int:
        return self.max_running_requests + self.max_queued_requests

    def check_n(self, n: object) -> None:
        if isinstance(n, int) and not isinstance(n, bool) and n > self.max_n:
            raise InvalidRequest(f"n={n} exceeds this server's limit of {self.max_n} (--max-n)")

    def check_params(self, params: SamplingParams) -> None:
        """Raise InvalidRequest when ``params`` exceed a size limit."""
        self.check_n(params.n)
        stop = params.stop if isinstance(params.stop, list) else [params.stop]
        if len(stop) > self.max_stop_strings:
            raise InvalidRequest(
                f"stop has {len(stop)} strings; the limit is {self.max_stop_strings} "
                "(--max-stop-strings)"
            )
        long = next((s for s in stop if isinstance(s, str) and len(s) > self.max_stop_length), "")
        if long:
            raise InvalidRequest(
                f"a stop string has {len(long)} characters ({long[:20]!r}...); the limit is "
                f"{self.max_stop_length} (--max-stop-length)"
            )
        regexes = params.stop_regex if isinstance(params.stop_regex, list) else []
        if len(regexes) > self.max_stop_strings:
            raise InvalidRequest(
                f"stop_regex has {len(regexes)} patterns; the limit is {self.max_stop_strings} "
                "(--max-stop-strings)",
                param="stop_regex",
            )
        too_long = (s for s in regexes if isinstance(s, str) and len(s) > self.max_stop_length)
        if long := next(too_long, ""):
            raise InvalidRequest(
                f"a stop_regex has {len(long)} characters ({long[:20]!r}...); the limit is "
                f"{self.max_stop_length} (--max-stop-length)",
                param="stop_regex",
            )
        if params.top_logprobs_num > self.max_top_logprobs:
            raise InvalidRequest(
                f"top_logprobs_num={params.top_logprobs_num} exceeds this server's limit of "
                f"{self.max_top_logprobs} (--max-top-logprobs)"
            )
        if len(params.stop_token_ids) > self.max_stop_strings:
            raise InvalidRequest(
                f"stop_token_ids has {len(params.stop_token_ids)} ids; the limit is "
                f"{self.max_stop_strings} (--max-stop-strings)"
            )

    def check_batch(self, count: int) -> None:
        """Raise InvalidRequest when one call asks for more generations than the server ever
        holds at once (it could never be admitted)."""
        if count > self.max_live:
            raise InvalidRequest(
                f"this call asks for {count} generations (prompts x n); the server holds at "
                f"most {self.max_live} at once (--max-running-requests + --max-queued-requests); "
                "send them in smaller calls"
            )

    def admit(self, live: int, count: int, draining: bool) -> None:
        """Raise Overloaded unless ``count`` more requests fit next to ``live`` ones (and
        InvalidRequest when they never could)."""
        self.check_batch(count)
        if draining:
            raise Overloaded("the server is shutting down; retry on another replica")
        if live + count > self.max_live:
            raise Overloaded(
                f"the server is at capacity ({live} requests running or queued, limit "
                f"{self.max_live} = --max-running-requests + --max-queued-requests); retry later"
            )
