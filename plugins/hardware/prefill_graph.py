"""Prefill steps padded to fixed shapes, so that a CUDA graph can replay them.

A short prompt's eager prefill is host-bound on a GPU: every layer launches its kernels from
Python (the default model on an H200: ~24 ms of host time for a ~60-token prompt, against ~1 ms
for a decode step from a graph; bench/HISTORY.md). ``PaddedPrefill`` holds static inputs for
a prefill step of up to R requests and T new tokens, padded to one of a few shapes
(``prefill_shapes``), and runs the forward from them; ``CudaGraphRunner`` captures that run
once per shape and replays it.

Padding keeps the real rows exact. The real requests' new tokens come first; the rest of the T
rows form one padding request on the req->token table's padding row (every position slot 0):
its tokens write their K/V to slot 0, which no request owns, and attend only to slot 0, so they
compute finite values like a decode graph's padding rows. Unused request places have no new
tokens (the extend kernel skips them). The attention metadata (``prepare_extend_graph``) is
built on the device from one int64 tensor [5, R + 1]: request rows, sequence lengths, new
tokens, first flattened row and the logits row of each request (its last new token), which the
host fills with one copy per step.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.memory import ReqToTokenPool

#: requests a prefill graph takes (a step's requests are padded up to one of these)
PREFILL_GRAPH_REQUESTS = (1, 2, 4)
#: the smallest token count of a prefill graph; the others double up to the maximum
MIN_PREFILL_GRAPH_TOKENS = 32

Shape = tuple[int, int]  # (requests, new tokens)


class ExtendGraphAttention(Protocol):
    def prepare_extend_graph(self, meta: torch.Tensor, max_ext_len: int) -> None: ...


def prefill_token_sizes(max_tokens: int) -> list[int]:
    """32, 64, 128, ... up to ``max_tokens``, which is always the last (none for 0)."""
    sizes = []
    size = MIN_PREFILL_GRAPH_TOKENS
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens] if max_tokens > 0 else []


def prefill_shapes(max_tokens: int) -> list[Shape]:
    """Every (requests, tokens) shape, largest tokens first (graphs captured in this order
    reuse the largest one's memory)."""
    sizes = sorted(prefill_token_sizes(max_tokens), reverse=True)
    return [(r, t) for t, r in itertools.product(sizes, PREFILL_GRAPH_REQUESTS)]


class PaddedPrefill:
    def __init__(
        self,
        model: Any,
        attention: ExtendGraphAttention,
        kv_pool: Any,
        req_to_token: ReqToTokenPool,
        pad_row: int,
        max_tokens: int,
        device: str,
    ) -> None:
        self.model, self.attention = model, attention
        # The padding request reads positions 0 .. T - n - 1 of the padding row: at most the
        # table's width (a context length under the limit caps it).
        max_tokens = min(max_tokens, req_to_token.table.shape[1])
        self.shapes = prefill_shapes(max_tokens)
        self._tokens = sorted({t for _, t in self.shapes})
        self.pad_row = pad_row
        self._kv_pool, self._req_to_token = kv_pool, req_to_token
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_tokens, **long)  # type: ignore[arg-type]
        self.positions = torch.zeros(max_tokens, **long)  # type: ignore[arg-type]
        self.out_cache_loc = torch.zeros(max_tokens, **long)  # type: ignore[arg-type]
        # per request count: [rows, seq lens, new tokens, first rows, logits rows] x (R + 1)
        self.meta = {r: torch.zeros(5, r + 1, **long) for r in PREFILL_GRAPH_REQUESTS}  # type: ignore[arg-type]

    def shape_for(self, batch: ForwardBatch) -> Shape | None:
        """The smallest shape that holds this step, or None: only steps of prefill chunks
        that need each request's last logits row alone (no input logprobs, drafts or pooled
        hidden states) are padded."""
        bs, n = batch.batch_size, batch.num_tokens
        if batch.num_decode or batch.hidden_rows is not None or batch.logits_indices.numel() != bs:
            return None
        r = next((r for r in PREFILL_GRAPH_REQUESTS if r >= bs), None)
        t = next((t for t in self._tokens if t >= n), None)
        return None if r is None or t is None else (r, t)

    def static_batch(self, shape: Shape, capture_layers: tuple[int, ...]) -> ForwardBatch:
        """The batch a graph of ``shape`` runs, over the static inputs; ``reset`` (or
        ``fill``) first."""
        r, t = shape
        meta = self.meta[r]
        return ForwardBatch(
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            out_cache_loc=self.out_cache_loc[:t],
            req_pool_indices=torch.full((r + 1,), self.pad_row, dtype=torch.int64),
            req_to_token=self._req_to_token.table,
            seq_lens=[0] * r + [t],
            extend_lens=[0] * r + [t],
            num_decode=0,
            logits_indices=meta[4, :r],
            kv_pool=self._kv_pool,
            req_to_token_pool=self._req_to_token,
            capture_hidden_layers=capture_layers,
        )

    def reset(self, shape: Shape) -> None:
        """Static inputs of an all-padding step (what a capture runs)."""
        r, t = shape
        self._write_meta(r, [[self.pad_row] * (r + 1), [0] * r + [t], [0] * r + [t],
                             [0] * (r + 1), [0] * (r + 1)])  # fmt: skip
        for static in (self.input_ids, self.positions, self.out_cache_loc):
            static[:t].zero_()

    def fill(self, batch: ForwardBatch, shape: Shape) -> None:
        """Copy ``batch`` (``shape_for`` gave ``shape``) into the static inputs."""
        r, t = shape
        bs, n = batch.batch_size, batch.num_tokens
        starts = list(itertools.accumulate(batch.extend_lens, initial=0))[:bs]
        empty, pad = r - bs, t - n
        self._write_meta(r, [
            batch.req_pool_indices.tolist() + [self.pad_row] * (empty + 1),
            batch.seq_lens + [0] * empty + [pad],
            batch.extend_lens + [0] * empty + [pad],
            starts + [n] * (empty + 1),
            [s + e - 1 for s, e in zip(starts, batch.extend_lens, strict=True)] + [0] * (empty + 1),
        ])  # fmt: skip
        for static, src in (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.out_cache_loc, batch.out_cache_loc),
        ):
            static[:n].copy_(src)
            if pad:
                static[n:t].zero_()

    def _write_meta(self, r: int, values: list[list[int]]) -> None:
        host = torch.tensor(values, dtype=torch.int64)
        if self.meta[r].is_cuda:
            host = host.pin_memory()  # pinned: the copy does not wait for the device
        self.meta[r].copy_(host, non_blocking=True)

    def prepare(self, shape: Shape) -> None:
        """The attention metadata from the static inputs, on the device (capturable)."""
        r, t = shape
        self.attention.prepare_extend_graph(self.meta[r][:4].to(torch.int32), t)
