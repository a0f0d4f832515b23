"""An EAGLE or EAGLE-3 head's whole speculative cycle from device state (core/spec_loop.py).

One cycle, per request, with L its KV length and x(L) its last token:
1. propose: the head's fixed catch-up over positions L - k - 1 .. L - 1 (a row reads the token
   after its position, from ``tokens``, and the target's feature of its position) and k - 1
   draft steps (``HeadChainGraphs.draft``);
2. verify: the target over [x(L), d1..dk] at positions L .. L + k (``TargetVerify``), which
   also writes the features of those positions;
3. accept: t = the target's argmax at each row, a = the drafts that match t's prefix; t0..ta
   are the new tokens. ``tokens`` gets t at positions L + 1 .. L + k + 1 (those past L + a + 1
   are rewritten before any cycle reads them) and L grows by a + 1.

Nothing in it reads the host, so the host can queue the next cycle before it has read this
one's tokens; on CUDA the cycle is one graph per batch size. A cycle's catch-up rewrites
positions the head already trusted with the same values (as the proposal graph does), and its
draft-step rows past L + a are rewritten by the next cycle's catch-up before they are trusted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.core.batch import to_device
from radixserve.core.interfaces import DeviceCycle, TargetVerify
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.request import Req, token_slice
from radixserve.plugins.speculative.head_chain import HeadChainGraphs


class HeadCycle(DeviceCycle):
    def __init__(
        self,
        drafter: Any,  # head_draft.HeadDraft after setup
        chain: HeadChainGraphs,
        verify: TargetVerify,
        req_to_token: ReqToTokenPool,
        max_batch: int,
        device: str,
        capture: bool,
    ) -> None:
        """``capture``: each batch size's cycle becomes a CUDA graph, captured here (on first
        use, a capture would stall the first loop of each size)."""
        self.drafter, self.chain, self.verify = drafter, chain, verify
        self.k = chain.k
        self.q = q = chain.k + 1
        self.max_batch = max_batch
        self.capture = capture
        self.device = device
        self.req_to_token = req_to_token
        self.table = req_to_token.device_table(device)  # allocated once: graphs may keep it
        # Per request slot: its tokens by position (each cycle reads x(L - k) .. x(L) and
        # writes k + 1 past L), its table row and its length L.
        width = req_to_token.max_context + 2 * q + 1
        self.tokens = torch.zeros(max_batch, width, dtype=torch.int64, device=device)
        self.rows = torch.full((max_batch,), req_to_token.pad_row, dtype=torch.int32, device=device)
        self.kv_lens = torch.full((max_batch,), q, dtype=torch.int32, device=device)
        self.offsets = torch.arange(q, dtype=torch.int64, device=device)
        # The cycle's result per request: t0..tk, then a.
        self.out = torch.zeros(max_batch, q + 1, dtype=torch.int64, device=device)
        self.graphs: dict[int, Any] = {}
        self._pool: Any = None
        self.bs = 0
        if capture:
            drafter.warm_catch_up(max_batch)
            for bs in range(max_batch, 0, -1):  # largest first: smaller graphs reuse its memory
                self._capture(bs)

    def _cycle(self, bs: int) -> None:
        q, k = self.q, self.k
        rows, lens, tokens = self.rows[:bs], self.kv_lens[:bs], self.tokens[:bs]
        first = lens.long()[:, None]
        table_rows = rows.long()[:, None]
        catch_up = first - q + self.offsets[None, :]  # positions L - k - 1 .. L - 1
        drafts = self.chain.draft(
            tokens.gather(1, catch_up + 1),
            self.table[table_rows, catch_up].long(),
            self.table[table_rows, first + self.offsets[None, : k - 1]].long(),
            rows,
            lens,
        )
        drafted = torch.stack(drafts, dim=1)  # [bs, k]
        verify_pos = first + self.offsets[None, :]  # L .. L + k
        logits = self.verify(
            torch.cat([tokens.gather(1, first), drafted], dim=1).reshape(-1),
            verify_pos.reshape(-1),
            self.table[table_rows, verify_pos].long().reshape(-1),
            rows,
            lens + q,
            q,
        )
        target = logits.argmax(dim=-1).view(bs, q)
        accepted = (drafted == target[:, :k]).int().cumprod(dim=1).sum(dim=1)
        tokens.scatter_(1, verify_pos + 1, target)
        self.out[:bs, :q].copy_(target)
        self.out[:bs, q].copy_(accepted)
        lens.add_(accepted.to(lens.dtype) + 1)

    def _capture(self, bs: int) -> None:
        from radixserve.plugins.hardware.cuda_graph import capture_graph

        # The warm-up runs write at the padding row's slot 0, which no request owns.
        self.rows[:bs].fill_(self.req_to_token.pad_row)
        self.kv_lens[:bs].fill_(self.q)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self.graphs[bs] = capture_graph(lambda: self._cycle(bs), self._pool)[0]

    def begin(self, reqs: Sequence[Req]) -> None:
        bs, q = len(reqs), self.q
        assert 0 < bs <= self.max_batch
        self.drafter.catch_up_to_span(reqs, q)
        last = [token_slice(r.input_ids, r.output_ids, r.kv_len - q + 1, q) for r in reqs]
        where = [[r.kv_len - q + 1 + j for j in range(q)] for r in reqs]
        packed = torch.tensor([where, last], dtype=torch.int64)
        packed = to_device(packed, self.device)
        self.tokens[:bs].scatter_(1, packed[0], packed[1])
        meta = torch.tensor([[r.req_pool_idx for r in reqs], [r.kv_len for r in reqs]])
        meta = to_device(meta.to(torch.int32), self.device)
        self.rows[:bs].copy_(meta[0])
        self.kv_lens[:bs].copy_(meta[1])
        self.bs = bs

    def launch(self) -> Callable[[], list[list[int]]]:
        bs = self.bs
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._cycle(bs)
        # a copy: the next cycle rewrites ``out`` before this one is read
        return self.drafter.platform.copy_to_host_async(self.out[:bs].clone())

    def end(self, reqs: Sequence[Req], trusted: Sequence[int]) -> None:
        for req, length in zip(reqs, trusted, strict=True):
            self.drafter.record_draft_kv(req, length)
