"""What draft models (standalone, eagle3) share: the record of a request's draft KV and the
ForwardBatch of a draft step.

A draft model keeps its own KV at the target's slots (the slot table is shared), so a row
rewritten by the scheduler (a shared prefix re-pointed, a retraction, a slot reused) leaves
draft KV that belongs to other tokens: ``trusted_length`` compares the row with the slots the
draft wrote, and the draft recomputes from the first position that differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.core.batch import ForwardBatch, to_device
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.core.request import Req


@dataclass(slots=True)
class DraftKV:
    length: int  # positions [0, length) hold draft KV written for this request
    slots: torch.Tensor  # the row's slots of those positions when they were written

    @classmethod
    def written(cls, req: Req, length: int, req_to_token: ReqToTokenPool) -> DraftKV:
        """The record after the draft wrote positions [0, length) of ``req``."""
        assert req.req_pool_idx is not None
        return cls(length, req_to_token.table[req.req_pool_idx, :length].clone())


def trusted_length(kv: DraftKV | None, req: Req, req_to_token: ReqToTokenPool) -> int:
    """How many leading positions of ``req`` hold draft KV (``kv``) it can still use."""
    if kv is None:
        return 0
    n = min(kv.length, req.kv_len)
    assert req.req_pool_idx is not None
    return leading_true(req_to_token.table[req.req_pool_idx, :n] == kv.slots[:n])


def leading_true(mask: torch.Tensor) -> int:
    """How many leading entries of the boolean ``mask`` are true."""
    return len(mask) if bool(mask.all()) else int((~mask).nonzero()[0, 0])


def draft_batch(
    reqs: Sequence[Req],
    spans: Sequence[tuple[int, int, int]],
    input_ids: torch.Tensor,
    req_to_token: ReqToTokenPool,
    kv_pool: KVPool,
    device: torch.device | str,
) -> ForwardBatch:
    """The ForwardBatch of a draft step over ``spans`` (request index, first position, number
    of tokens), decodes first, with ``input_ids`` the step's tokens on the device; its logits
    rows are each span's last token."""
    table = req_to_token.table
    positions: list[int] = []
    rows: list[int] = []
    pool_rows: list[int] = []
    seq_lens: list[int] = []
    extend_lens: list[int] = []
    last_rows: list[int] = []
    for i, start, n in spans:
        row = reqs[i].req_pool_idx
        assert row is not None
        positions += range(start, start + n)
        rows += [row] * n
        pool_rows.append(row)
        seq_lens.append(start + n)
        extend_lens.append(n)
        last_rows.append(len(positions) - 1)
    positions_t = torch.tensor(positions, dtype=torch.int64)
    out_cache_loc = table[torch.tensor(rows), positions_t]
    req_to_token.sync()
    return ForwardBatch(
        input_ids=input_ids,
        positions=to_device(positions_t, device),
        out_cache_loc=to_device(out_cache_loc, device),
        req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64),
        req_to_token=table,
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        num_decode=sum(1 for n in extend_lens if n == 1),
        logits_indices=to_device(torch.tensor(last_rows, dtype=torch.int64), device),
        kv_pool=kv_pool,
        req_to_token_pool=req_to_token,
    )


def rows_by_request(
    steps: Sequence[tuple[list[int], torch.Tensor]], num_reqs: int
) -> list[list[int]]:
    """Each request's rows in the concatenation of the draft steps' tokens, where a step is
    (the request indices it drafted for, in order; their tokens)."""
    where: list[list[int]] = [[] for _ in range(num_reqs)]
    at = 0
    for order, _ in steps:
        for i in order:
            where[i].append(at)
            at += 1
    return where


def catch_up_spans(reqs: Sequence[Req], trusted: Sequence[int]) -> list[tuple[int, int, int]]:
    """A proposal's first head step, (request index, first position, rows), decodes first:
    each request's rows from its first untrusted position (at most kv_len - 1, the row that
    reads its last token) to kv_len - 1."""
    spans = []
    for i, (req, t) in enumerate(zip(reqs, trusted, strict=True)):
        start = min(t, req.kv_len - 1)
        spans.append((i, start, req.kv_len - start))
    return sorted(spans, key=lambda e: e[2] != 1)
