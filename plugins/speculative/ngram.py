"""Speculative algorithm ``ngram``: prompt/history lookup drafting, no draft model.

Why: on input-grounded tasks (code edits, JSON that echoes its input, quoting a passage) the
model's next tokens very often repeat a span it has already seen. Looking the trailing tokens
up in the request's own history and proposing what followed them last time costs no model
call, and the target verifies the whole chain in one step. (Idea as in HF prompt lookup, vLLM
``ngram`` and SGLang's NGRAM; this is our own, simpler chain-only implementation.)

Matching. For a request with history ``h = input_ids + output_ids`` of length ``L``, try
``n`` from ``speculative_ngram_max_match_window_size`` (W) down to
``speculative_ngram_min_match_window_size``: the first ``n`` whose trailing n-gram
``h[L-n:]`` occurred earlier (ending before ``L-1``) wins, i.e. the longest match; among its
occurrences the most recent one is used. The draft is the tokens that followed that
occurrence, ``h[e : e + limit]`` where ``e`` is the end of the occurrence; it never runs past
the end of the history, so it may be shorter than ``limit``.

Adaptive length. A short match is weak evidence, so it gets a short draft::

    limit = max_drafts[i]                      if n >= W
    limit = min(max_drafts[i], 2 * n)          otherwise

(``n == 1`` proposes at most 2 tokens, ``n == 2`` at most 4, and so on.)

Index. Per request (keyed by ``req.rid``) one dict per window size ``n`` maps an n-gram tuple
to the end position of its latest occurrence that has at least one following token. Each
``propose`` adds only the tokens appended since the previous call (the n-grams ending at
each newly "closed" position: at most W dict writes per token) and then does at most W dict
reads, so a step costs O(W) dict operations per new token whatever the history length; the
history is never concatenated or rescanned. The request's history is rebuilt from scratch
only when it no longer extends what was indexed (a different prompt length, a shorter output,
or a changed last indexed token: e.g. the rid was reused for a fresh request). Memory is
W dict entries per history token: about 1.5 KB per token at W = 12 (30 MB for a 20k-token
request), freed by ``release``.

Shared index. When a request is released (finished, aborted or retracted), its last
``shared_max_tokens`` tokens go into one index shared by all requests: LRU over at most
``shared_max_requests`` requests and ``shared_max_tokens`` tokens (defaults 64 and 32,768,
about 70 MB at most at W = 12). Adding costs W dict writes per token once, evicting the same.
Each step it is consulted (at most W more dict reads) only when the request's own match is
shorter than W, and it is used only when its match is strictly longer than the own one (ties
go to the request's own history). It makes repeated runs of the same prompt (benchmark
warm-ups, for instance) draft the earlier run's output; pass ``shared_max_requests=0`` to
switch it off. Drafts never change outputs (the target verifies every token), only speed.

Counting. ``dict_ops`` counts every dict read and write the plugin makes, so tests can check
the per-step cost without timing anything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Draft, SpeculativeAlgorithm, SpeculativeContext

DEFAULT_MIN_WINDOW = 1
DEFAULT_MAX_WINDOW = 12
DEFAULT_SHARED_MAX_REQUESTS = 64
DEFAULT_SHARED_MAX_TOKENS = 1 << 15


def draft_limit(match_len: int, max_draft: int, max_window: int) -> int:
    """The adaptive draft length for a match of ``match_len`` tokens (module docstring)."""
    if match_len >= max_window:
        return max_draft
    return min(max_draft, 2 * match_len)


class _Counter:
    """Counts dict operations (shared by a plugin and its indexes)."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops = 0


class NgramIndex:
    """An incremental index over one token sequence: n-gram -> end of its latest occurrence.

    Only n-grams with at least one following token are indexed, so the trailing n-gram of the
    sequence itself is never its own match.
    """

    def __init__(self, min_window: int, max_window: int, counter: _Counter | None = None) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, {max_window}")
        self.min_window = min_window
        self.max_window = max_window
        self.tokens: list[int] = []
        # _tables[n - min_window]: n-gram tuple -> position just after its latest occurrence
        self._tables: list[dict[tuple[int, ...], int]] = [
            {} for _ in range(max_window - min_window + 1)
        ]
        self._counter = counter if counter is not None else _Counter()

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens and index the n-grams they close (O(W) dict writes per token)."""
        if not new_tokens:
            return
        toks = self.tokens
        start = len(toks)
        toks.extend(new_tokens)
        lo, hi = self.min_window, self.max_window
        tables = self._tables
        # An n-gram ending at position p is indexed once token p + 1 exists.
        for p in range(max(start - 1, 0), len(toks) - 1):
            end = p + 1
            for n in range(lo, min(hi, end) + 1):
                tables[n - lo][tuple(toks[end - n : end])] = end
            self._counter.ops += max(0, min(hi, end) - lo + 1)

    def match(self, tail: Sequence[int], max_n: int | None = None) -> tuple[int, int] | None:
        """The longest n (<= ``max_n``) whose last-n tokens of ``tail`` are indexed, as
        ``(n, end)`` with ``end`` the position after the latest occurrence; None if none."""
        lo = self.min_window
        top = min(self.max_window, len(tail))
        if max_n is not None:
            top = min(top, max_n)
        tables = self._tables
        t = len(tail)
        for n in range(top, lo - 1, -1):
            self._counter.ops += 1
            end = tables[n - lo].get(tuple(tail[t - n : t]))
            if end is not None:
                return n, end
        return None

    def lookup(self, max_tokens: int) -> tuple[int, list[int]]:
        """Match this sequence's own trailing n-gram against its earlier tokens: ``(n, draft)``
        with the draft cut by the adaptive rule and ``max_tokens``; ``(0, [])`` if none."""
        toks = self.tokens
        if max_tokens <= 0 or len(toks) < self.min_window + 1:
            return 0, []
        # An earlier occurrence of length n needs n <= len - 1 tokens before the last one.
        hit = self.match(toks, max_n=len(toks) - 1)
        if hit is None:
            return 0, []
        n, end = hit
        limit = draft_limit(n, max_tokens, self.max_window)
        return n, toks[end : end + limit]


class SharedNgramIndex:
    """The n-grams of recently released requests, LRU-bounded by requests and tokens."""

    def __init__(
        self,
        min_window: int,
        max_window: int,
        max_requests: int,
        max_tokens: int,
        counter: _Counter | None = None,
    ) -> None:
        self.min_window = min_window
        self.max_window = max_window
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._counter = counter if counter is not None else _Counter()
        self._entries: OrderedDict[int, list[int]] = OrderedDict()  # seq -> tokens, LRU order
        self._tables: list[dict[tuple[int, ...], tuple[int, int]]] = [
            {} for _ in range(max_window - min_window + 1)
        ]
        self._next_seq = 0
        self.num_tokens = 0

    @property
    def num_requests(self) -> int:
        return len(self._entries)

    def _keys(self, toks: list[int]):  # type: ignore[no-untyped-def]
        lo, hi = self.min_window, self.max_window
        for end in range(1, len(toks)):
            for n in range(lo, min(hi, end) + 1):
                yield n - lo, tuple(toks[end - n : end]), end

    def add(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` (only the most recent ``max_tokens`` of them), evicting old ones."""
        if self.max_requests <= 0 or self.max_tokens <= 0 or len(tokens) < 2:
            return
        toks = list(tokens[-self.max_tokens :])
        seq = self._next_seq
        self._next_seq += 1
        self._entries[seq] = toks
        self.num_tokens += len(toks)
        for i, key, end in self._keys(toks):
            self._counter.ops += 1
            self._tables[i][key] = (seq, end)
        while len(self._entries) > self.max_requests or self.num_tokens > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        seq, toks = self._entries.popitem(last=False)
        self.num_tokens -= len(toks)
        for i, key, _ in self._keys(toks):
            table = self._tables[i]
            self._counter.ops += 1
            owner = table.get(key)
            if owner is not None and owner[0] == seq:
                del table[key]

    def lookup(self, tail: Sequence[int], max_tokens: int, min_n: int) -> tuple[int, list[int]]:
        """The longest match (of at least ``min_n`` tokens) of ``tail``'s trailing n-gram:
        ``(n, draft)``; ``(0, [])`` if none."""
        if max_tokens <= 0 or not self._entries:
            return 0, []
        lo = max(self.min_window, min_n)
        t = len(tail)
        for n in range(min(self.max_window, t), lo - 1, -1):
            self._counter.ops += 1
            hit = self._tables[n - self.min_window].get(tuple(tail[t - n : t]))
            if hit is not None:
                seq, end = hit
                self._entries.move_to_end(seq)
                toks = self._entries[seq]
                limit = draft_limit(n, max_tokens, self.max_window)
                return n, toks[end : end + limit]
        return 0, []


class _ReqState:
    __slots__ = ("index", "num_input", "num_output")

    def __init__(self, index: NgramIndex, num_input: int, num_output: int) -> None:
        self.index = index
        self.num_input = num_input
        self.num_output = num_output


class NgramSpeculation(SpeculativeAlgorithm):
    """Drafts the continuation of the longest earlier occurrence of the trailing n-gram."""

    def __init__(
        self,
        min_window: int | None = None,
        max_window: int | None = None,
        shared_max_requests: int = DEFAULT_SHARED_MAX_REQUESTS,
        shared_max_tokens: int = DEFAULT_SHARED_MAX_TOKENS,
    ) -> None:
        self._explicit_windows = (min_window, max_window)
        self._shared_limits = (shared_max_requests, shared_max_tokens)
        self._counter = _Counter()
        self._states: dict[str, _ReqState] = {}
        self._configure(
            min_window if min_window is not None else DEFAULT_MIN_WINDOW,
            max_window if max_window is not None else DEFAULT_MAX_WINDOW,
        )

    def _configure(self, min_window: int, max_window: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, {max_window}")
        self.min_window = min_window
        self.max_window = max_window
        self._states.clear()
        reqs, toks = self._shared_limits
        self.shared = SharedNgramIndex(min_window, max_window, reqs, toks, self._counter)

    @property
    def dict_ops(self) -> int:
        """Dict reads and writes made so far (indexing, lookups, shared index)."""
        return self._counter.ops

    def setup(self, context: SpeculativeContext) -> None:
        cfg = context.config
        lo, hi = self._explicit_windows
        self._configure(
            lo if lo is not None else int(cfg.speculative_ngram_min_match_window_size),
            hi if hi is not None else int(cfg.speculative_ngram_max_match_window_size),
        )

    def _state(self, req: Any) -> _ReqState:
        """The request's index, caught up with its current history."""
        inp: list[int] = req.input_ids
        out: list[int] = req.output_ids
        st = self._states.get(req.rid)
        if st is not None:
            idx = st.index
            stale = len(inp) != st.num_input or len(out) < st.num_output
            if not stale and idx.tokens:
                last = out[st.num_output - 1] if st.num_output else inp[-1]
                stale = last != idx.tokens[-1]
            if not stale:
                if len(out) > st.num_output:
                    idx.extend(out[st.num_output :])
                    st.num_output = len(out)
                return st
        idx = NgramIndex(self.min_window, self.max_window, self._counter)
        idx.extend(inp)
        idx.extend(out)
        st = _ReqState(idx, len(inp), len(out))
        self._states[req.rid] = st
        return st

    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        drafts: list[Draft] = []
        for req, k in zip(reqs, max_drafts, strict=True):
            if k <= 0:
                drafts.append(Draft(tokens=[]))
                continue
            idx = self._state(req).index
            n, tokens = idx.lookup(k)
            if n < self.max_window and self.shared.num_requests:
                tail = idx.tokens[-self.max_window :]
                sn, stokens = self.shared.lookup(tail, k, min_n=n + 1)
                if sn > n:
                    tokens = stokens
            drafts.append(Draft(tokens=list(tokens)))
        return drafts

    def release(self, rid: str) -> None:
        st = self._states.pop(rid, None)
        if st is not None:
            self.shared.add(st.index.tokens)


@hookimpl
def register_speculative_algorithms(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "ngram",
        NgramSpeculation,
        description="n-gram lookup in the request's own tokens (and recent requests'); no model",
    )
