"""Stop conditions after each new token: stop token ids, EOS, stop strings, length limits.

Text for stop strings comes from the request's incremental detokenizer, so each token costs one
small decode, never a decode of the whole output.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from re import _parser as sre_parse  # type: ignore[attr-defined]

import regex  # its search takes a timeout; re's cannot be interrupted

from radixserve.core.request import FinishReason, Req
from radixserve.core.tokenizer import IncrementalDetokenizer, Tokenizer

TopLogprobs = list[tuple[float, int]]


def partial_marker(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``:
    a tail that may still grow into a marker (a stop string, a tool-call or think tag)."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def streamable_text(text: str, stop: Sequence[str]) -> str:
    """The part of a running request's ``text`` that is safe to stream: a tail that could still
    grow into one of the ``stop`` strings is held back, because a matched stop string is cut
    from the output and streamed text is never taken back. A finished request's text is final.
    """
    hold = partial_marker(text, stop)
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
        if delta and len(req.output_ids) >= params.min_new_tokens:
            if params.stop and self._match_stop_string(req, detok, len(delta)):
                return
            if params.stop_regex and _match_stop_regex(req, detok, len(delta)):
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


#: How long one stop_regex search may take before its request is ended: a pattern that
#: backtracks catastrophically ((x|xx)+y over 30 characters) would otherwise hold the engine's
#: thread, and every request with it. Searching 8,000 characters takes 2-90 µs for sane ones.
STOP_REGEX_TIMEOUT_S = 0.05


def _match_stop_regex(req: Req, detok: IncrementalDetokenizer, delta_len: int) -> bool:
    """Finish ``req`` when its text, grown by ``delta_len`` characters, matches one of its
    ``stop_regex`` patterns. The match is kept (SGLang's server keeps it: its trimming looks
    for the pattern's own text); anything after the match is cut. Keeping the match means no
    tail ever has to be held back from a stream for a regex."""
    text = detok.text
    best: tuple[int, str] | None = None
    for pattern in req.sampling.stop_regex:
        compiled, longest = _compiled(pattern)
        # NOTE: a match found now must end in the new text (earlier text was searched at
        # earlier tokens), so a pattern no longer than ``longest`` characters starts at most
        # that far before it: searching from there keeps a step's work bounded. search(text,
        # pos) still sees the text before pos for lookbehinds and \b, and ^ stays anchored at
        # the real start. A pattern without a bound (+, *, {n,}, backreferences) is searched
        # from the start, since a window could miss its match: measured on 8,000 characters of
        # output, 2-90 µs per step (r"---+" .. r"\d+233") against 0.2-0.3 µs for a window;
        # SGLang also rescans the whole output for such patterns (and re-decodes it).
        start = 0 if longest is None else max(len(text) - delta_len - longest + 1, 0)
        try:
            m = compiled.search(text, start, timeout=STOP_REGEX_TIMEOUT_S)
        except TimeoutError:
            message = (
                f"stop_regex {pattern[:80]!r} took over {STOP_REGEX_TIMEOUT_S * 1e3:.0f} ms to "
                "search the output (catastrophic backtracking); simplify the pattern"
            )
            req.finish(FinishReason("abort", message=message))
            return True
        if m is not None and (best is None or m.end() < best[0]):
            best = (m.end(), pattern)
    if best is None:
        return False
    end, pattern = best
    detok.text = text[:end]
    req.finish(FinishReason("stop", matched=pattern))
    return True


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> tuple[regex.Pattern[str], int | None]:
    """The compiled pattern (``regex``, re's syntax) and the most characters a match can span
    (None: no bound)."""
    return regex.compile(pattern), _max_width(sre_parse.parse(pattern))


def _max_width(parsed: object) -> int | None:
    total = 0
    for op, arg in parsed:  # type: ignore[attr-defined]
        name = str(op)
        if name in ("LITERAL", "NOT_LITERAL", "IN", "ANY"):
            width: int | None = 1
        elif name == "AT":
            width = 0
        elif name in ("ASSERT", "ASSERT_NOT"):
            # a lookahead reads past the match (count it: the text it needs may be the new
            # text); a lookbehind reads before it, which search(text, pos) still sees
            direction, inner = arg
            width = _max_width(inner) if direction > 0 else 0
        elif name == "SUBPATTERN":
            width = _max_width(arg[-1])
        elif name == "BRANCH":
            widths = [_max_width(b) for b in arg[1]]
            width = None if None in widths else max(w for w in widths if w is not None)
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, inner = arg
            inner_width = _max_width(inner)
            width = None if hi == sre_parse.MAXREPEAT or inner_width is None else hi * inner_width
        else:  # backreferences, atomic groups, ...: no bound known
            width = None
        if width is None:
            return None
        total += width
    return total
