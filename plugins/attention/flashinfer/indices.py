"""FlashInfer's paged-KV description of a batch, built from the req->token table.

FlashInfer reads a batch's KV as pages: request ``i`` owns the pages
``indices[indptr[i] : indptr[i + 1]]`` in order, and only the first ``last_page_len[i]`` entries
of its last page count. With page size P our table keeps a slot per position and positions
[k * P, (k + 1) * P) of a request sit in one page, in order (core/memory.py), so page ``k`` of a
request is ``table[row, k * P] // P``.

``indptr`` and ``last_page_len`` follow from the sequence lengths alone and are built on the host
(FlashInfer's ``plan`` reads them there); the page indices are gathered on the device from the
pool's device mirror, so a long batch costs the host nothing per page.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PageLayout(NamedTuple):
    indptr: list[int]  # [B + 1] first page entry of each request, then the total
    last_page_len: list[int]  # [B] entries used in each request's last page (1..P)
    pages: list[int]  # [B] pages of each request


def page_layout(seq_lens: list[int], page_size: int) -> PageLayout:
    """The host part of the description for sequences of ``seq_lens`` tokens (each >= 1)."""
    pages = [-(-n // page_size) for n in seq_lens]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    last = [n - (k - 1) * page_size for n, k in zip(seq_lens, pages, strict=True)]
    return PageLayout(indptr, last, pages)


def gather_page_indices(
    table: torch.Tensor,
    req_rows: torch.Tensor,
    pages: torch.Tensor,
    starts: torch.Tensor,
    total: int,
    page_size: int,
) -> torch.Tensor:
    """The page indices of the requests at table rows ``req_rows``, request after request.

    ``pages`` and ``starts`` (the exclusive prefix sum of ``pages``) are on ``table``'s device,
    ``total`` is their sum, known on the host: with it no step here waits for the device.
    Returns int32 page indices, ``total`` of them.
    """
    device = table.device
    owner = torch.repeat_interleave(
        torch.arange(len(pages), device=device), pages, output_size=total
    )
    within = torch.arange(total, device=device) - starts[owner]
    slots = table[req_rows[owner], within * page_size]
    return torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)
