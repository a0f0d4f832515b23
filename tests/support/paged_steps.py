"""Model steps built by hand over the real KV memory classes, for attention-backend tests."""

from __future__ import annotations

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.memory import ReqToTokenPool, TokenAllocator


def shuffled_allocator(size: int, page_size: int) -> TokenAllocator:
    """An allocator that hands out its pages in a random order."""
    alloc = TokenAllocator(size, page_size)
    everything = alloc.alloc(alloc.size)
    assert everything is not None
    for page in torch.randperm(alloc.size // page_size).tolist():
        alloc.free(everything[page * page_size : (page + 1) * page_size])
    return alloc


def extend_row(pool: ReqToTokenPool, alloc: TokenAllocator, row: int, start: int,
               n: int) -> list[int]:  # fmt: skip
    """Give table row ``row`` slots for positions start .. start + n - 1; return them."""
    slots = alloc.alloc_extend(pool.table[row], start, n)
    assert slots is not None
    pool.write(row, start, slots)
    return slots.tolist()


def step_batch(
    pool: ReqToTokenPool,
    alloc: TokenAllocator,
    rows: list[int],
    kv_lens: list[int],
    new: list[int],
    nd: int,
    device: str,
    kv_pool: object = None,
) -> ForwardBatch:
    """Give each request ``new`` slots after its ``kv_lens`` cached ones; build the batch (the
    first ``nd`` requests are decodes)."""
    out_loc: list[int] = []
    for row, start, n in zip(rows, kv_lens, new, strict=True):
        out_loc += extend_row(pool, alloc, row, start, n)
    t = len(out_loc)
    return ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64, device=device),
        positions=torch.zeros(t, dtype=torch.int64, device=device),
        out_cache_loc=torch.tensor(out_loc, device=device),
        req_pool_indices=torch.tensor(rows),
        req_to_token=pool.table,
        seq_lens=[s + n for s, n in zip(kv_lens, new, strict=True)],
        extend_lens=list(new),
        num_decode=nd,
        logits_indices=torch.zeros(0, dtype=torch.int64, device=device),
        kv_pool=kv_pool,
        req_to_token_pool=pool,
    )
