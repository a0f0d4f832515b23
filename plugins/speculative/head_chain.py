"""An EAGLE or EAGLE-3 head's whole proposal (catch-up and k draft steps) in one CUDA graph.

A head proposal is host-bound on a GPU: the head is one layer, so each eager step costs mostly
its batch building and launches. Its first step is a catch-up of variable length (the positions
the last verify accepted, 1 to k + 1 of them), which a graph cannot take as such; so the graph
always recomputes the last ``k + 1`` positions of each request from the feature pool. Positions
the head already trusted are written again with the same values (their token, feature and KV
prefix are unchanged), so a fixed-length catch-up drafts exactly what the variable one does.
The catch-up rows attend like a verify step (each row a decode ending at itself, its K/V stored
first: ``prepare_verify_graph``), and draft steps 2..k are decodes fed by the previous step's
token and the head's own hidden state.

The graph serves a proposal when every request drafts the full k tokens and trusts its draft
KV up to at least ``kv_len - k - 1``. Draft KV that lags further (a new or retracted request,
the decodes of a pause, a row the prefix cache re-pointed) is first written by one eager head
forward (``HeadDraft.catch_up_to_span``); shortened drafts, a batch larger than the
largest graph and requests shorter than the span run the plugin's eager steps.

Padding rows read the slot table's padding row and write their K/V to slot 0, as the decode
graphs do (plugins/hardware/cuda_graph.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.core.batch import ForwardBatch, prepare_from_device
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.request import Req, token_slice
from radixserve.plugins.speculative.draft_chain import stage


class HeadChainGraphs:
    def __init__(
        self,
        drafter: Any,
        req_to_token: ReqToTokenPool,
        num_steps: int,
        sizes: Sequence[int],
        device: str,
        capture: bool = True,
    ) -> None:
        """``drafter``: the HeadDraft plugin after setup (its head, embed, attention, draft KV
        pool and feature pool). Without ``capture`` no graph is captured: ``draft`` then runs
        eagerly inside a speculative cycle (``head_cycle.py``; on the CPU, in tests)."""
        self.drafter = drafter
        self.req_to_token = req_to_token
        self.k = num_steps
        self.span = num_steps + 1  # catch-up positions: the most one verify can add
        self.sizes = sorted(sizes)
        self.max_bs = self.sizes[-1]
        bind = getattr(drafter.attention, "bind_table", None)
        self.pad_row = bind(req_to_token) if bind is not None else req_to_token.pad_row
        self.replays = 0  # proposals served by a graph (tests read it)
        n = self.span
        # Rows of ``staged``, one column a request: the catch-up tokens [n], the catch-up slots
        # [n], the draft steps' slots [k - 1]; then the table rows and kv_len, copied to
        # ``meta`` as int32. One host-to-device copy a proposal.
        self.staged = torch.zeros(
            2 * n + num_steps + 1, self.max_bs, dtype=torch.int64, device=device
        )
        self.meta = torch.zeros(2, self.max_bs, dtype=torch.int32, device=device)
        self.meta[0].fill_(self.pad_row)
        self.meta[1].fill_(n)
        self.offsets = torch.arange(n, dtype=torch.int64, device=device)
        self.last_rows = torch.arange(self.max_bs, dtype=torch.int64, device=device) * n + n - 1
        self.out = torch.zeros(num_steps, self.max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, Any] = {}
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for bs in reversed(self.sizes):
                self.graphs[bs] = self._capture(bs, pool)

    def _step(
        self,
        ids: torch.Tensor,
        feature: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        q_len: int | None,
    ) -> torch.Tensor:
        """One head forward over ``ids``: decodes (``q_len`` None) or ``q_len`` rows per
        request attending like a verify; their hidden states."""
        d, n = self.drafter, ids.shape[0]
        batch = ForwardBatch(
            input_ids=ids,
            positions=positions,
            out_cache_loc=slots,
            req_pool_indices=torch.full((n,), self.pad_row, dtype=torch.int64),
            req_to_token=self.req_to_token.table,
            seq_lens=[1] * n,
            extend_lens=[1] * n,
            num_decode=n,
            logits_indices=self.offsets[:0],
            kv_pool=d.kv_pool,
            req_to_token_pool=self.req_to_token,
        )
        batch = prepare_from_device(d.attention, batch, rows, seq_lens, q_len)
        q, k, v, residual = d.head.qkv(d.embed(ids), feature, positions)
        return d.head.finish(d.attention.forward(q, k, v, 0, batch), residual)

    def draft(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        step_slots: torch.Tensor,
        rows: torch.Tensor,
        kv_lens: torch.Tensor,
    ) -> list[torch.Tensor]:
        """The k draft tokens of each request, one tensor [bs] a step, from device tensors
        alone: ``tokens`` and ``slots`` [bs, k + 1] of the catch-up positions kv_len - k - 1 ..
        kv_len - 1 (a row reads the token after its position), ``step_slots`` [bs, k - 1] of
        positions kv_len .. kv_len + k - 2, the requests' table ``rows`` and ``kv_lens``."""
        n, bs = self.span, rows.shape[0]
        first = kv_lens - n
        flat_slots = slots.reshape(-1)
        hidden = self._step(
            tokens.reshape(-1),
            self.drafter.features[flat_slots],
            (first[:, None] + self.offsets[None, :]).reshape(-1),
            flat_slots,
            rows,
            kv_lens,
            n,
        )[self.last_rows[:bs]]
        ids = self._draft(hidden)
        out = [ids]
        for step in range(1, self.k):  # position kv_len - 1 + step
            positions = first + n - 1 + step
            lens = kv_lens + step
            hidden = self._step(ids, hidden, positions, step_slots[:, step - 1], rows, lens, None)
            ids = self._draft(hidden)
            out.append(ids)
        return out

    def _draft(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.drafter.head
        return head.to_target(head.draft_logits(hidden).argmax(dim=-1))

    def _chain(self, bs: int) -> None:
        n, k, s = self.span, self.k, self.staged
        drafts = self.draft(
            s[:n, :bs].T,
            s[n : 2 * n, :bs].T,
            s[2 * n : 2 * n + k - 1, :bs].T,
            self.meta[0, :bs],
            self.meta[1, :bs],
        )
        for step, ids in enumerate(drafts):
            self.out[step, :bs].copy_(ids)

    def _capture(self, bs: int, pool: Any) -> Any:
        from radixserve.plugins.hardware.cuda_graph import capture_graph

        return capture_graph(lambda: self._chain(bs), pool)[0]

    def fits(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> bool:
        """Whether the step's shape is one a replay drafts: a captured batch size, full drafts,
        and at least the catch-up span of KV per request. The draft KV must also be trusted up
        to ``kv_len - span`` (``HeadDraft.catch_up_to_span`` sees to it)."""
        return (
            len(reqs) <= self.max_bs
            and all(m == self.k for m in max_drafts)
            and all(r.kv_len >= self.span for r in reqs)
        )

    def launch(self, reqs: Sequence[Req]) -> torch.Tensor:
        """Queue the k drafts of each request; return them on the device, [len(reqs), k]. The
        slots of positions kv_len .. kv_len + k - 2 must be allocated (the verify's)."""
        bs, n, k = len(reqs), self.span, self.k
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        pad = [0] * (self.max_bs - bs)
        table = self.req_to_token.table
        # Plain lists, one tensor built at the end: a proposal's host time is the GPU's idle
        # time at batch 1.
        tokens = [token_slice(r.input_ids, r.output_ids, r.kv_len - n + 1, n) for r in reqs]
        slots = [table[r.req_pool_idx, r.kv_len - n : r.kv_len + k - 1].tolist() for r in reqs]
        host = [
            *(list(col) + pad for col in zip(*tokens, strict=True)),
            *(list(col) + pad for col in zip(*slots, strict=True)),
            [r.req_pool_idx for r in reqs] + [self.pad_row] * len(pad),
            [r.kv_len for r in reqs] + [n] * len(pad),
        ]
        stage(self.staged, host, self.req_to_token)
        self.meta.copy_(self.staged[2 * n + k - 1 :])
        self.graphs[padded].replay()
        self.replays += 1
        # A copy: the next replay overwrites ``out`` while these may still wait to be read.
        return self.out[:, :bs].T.clone()
