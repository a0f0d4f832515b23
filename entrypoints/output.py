"""SGLang-shaped logprob entries: ``[logprob, token_id, token_text or None]`` triples."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[int], str] | None


def logprob_triples(
    logprobs: Sequence[float | None], token_ids: Sequence[int], decode: Decode = None
) -> list[list[float | int | str | None]]:
    return [
        [lp, tid, decode(tid) if decode else None]
        for lp, tid in zip(logprobs, token_ids, strict=True)
    ]


def top_logprob_triples(
    tops: Sequence[Sequence[tuple[float, int]]], decode: Decode = None
) -> list[list[list[float | int | str | None]]]:
    return [[[lp, tid, decode(tid) if decode else None] for lp, tid in top] for top in tops]


def input_logprob_entries(
    input_ids: Sequence[int],
    start: int,
    logprobs: Sequence[float],
    tops: Sequence[Sequence[tuple[float, int]]],
    decode: Decode = None,
) -> tuple[list[list[float | int | str | None]], list[list[list[float | int | str | None]]] | None]:
    """Entries for prompt positions ``start``.. ; position 0 (if included) has logprob None."""
    scored_from = max(start, 1)
    ids = input_ids[scored_from : scored_from + len(logprobs)]
    entries = logprob_triples(logprobs, ids, decode)
    top_entries = top_logprob_triples(tops, decode) if tops else None
    if start == 0 and input_ids:
        entries.insert(0, [None, input_ids[0], decode(input_ids[0]) if decode else None])
        if top_entries is not None:
            top_entries.insert(0, [])
    return entries, top_entries
