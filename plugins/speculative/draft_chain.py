"""The standalone drafter's k greedy draft steps in one CUDA graph.

On a GPU a draft model is small, so its steps cost mostly host time: building each step's batch
and launching it. When every request of a proposal feeds only its last token (its draft KV is
current) and drafts greedily, the k steps are a fixed chain of device work: feed the token,
run the draft model, take the argmax, feed it to the next position. It is captured once per
padded batch size and replayed with one host-to-device copy and one read of the k tokens.

After a verify step that accepted the whole draft, the draft's KV lacks exactly one position,
the token before the last; a second graph per batch size starts one step early to write it
(``refresh``). Otherwise (any draft token rejected) that KV is already there, and the chain
runs its k steps only: on a GPU one draft step of an 8B run's EAGLE-sized drafter costs a few
percent of a verify step, so the step saved is worth its graph.

The drafted tokens stay on the device (``launch`` returns them there): the verify step takes
them as its input without a host sync, and the host reads them with the verify result.

Padding rows read the slot table's padding row and write their K/V to slot 0, as the decode
graphs do (plugins/hardware/cuda_graph.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.request import Req, token_slice


class DraftChainGraphs:
    def __init__(
        self,
        model: Any,
        attention: Any,
        kv_pool: Any,
        req_to_token: ReqToTokenPool,
        num_steps: int,
        sizes: Sequence[int],
        device: str,
    ) -> None:
        self.model, self.attention, self.kv_pool = model, attention, kv_pool
        self.req_to_token = req_to_token
        self.k = num_steps
        self.sizes = sorted(sizes)
        self.max_bs = self.sizes[-1]
        self.pad_row = attention.bind_table(req_to_token)
        self.replays = 0  # proposals served by a graph (tests read it)
        self.refreshes = 0  # of which the graph that starts one position early
        # [the two last tokens | first positions | k + 1 slots] per row (``inputs``), then
        # [table rows | sequence lengths at the first step], copied to ``meta`` as int32: one
        # host-to-device copy a proposal.
        self.staged = torch.zeros(6 + num_steps, self.max_bs, dtype=torch.int64, device=device)
        self.inputs = self.staged[: 4 + num_steps]
        self.meta = torch.zeros(2, self.max_bs, dtype=torch.int32, device=device)
        self.meta[0].fill_(self.pad_row)
        self.meta[1].fill_(1)
        self.logits_indices = torch.arange(self.max_bs, dtype=torch.int64, device=device)
        self.out = torch.zeros(num_steps, self.max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            for refresh in (True, False):
                self.graphs[bs, refresh] = self._capture(bs, refresh, pool)

    def _chain(self, bs: int, refresh: bool) -> None:
        ids = self.inputs[0, :bs]
        for step in range(0 if refresh else 1, self.k + 1):
            if step == 1:
                ids = self.inputs[1, :bs]  # the last token; step 0 only refreshed the KV
            batch = ForwardBatch(
                input_ids=ids,
                positions=self.inputs[2, :bs] + step,
                out_cache_loc=self.inputs[3 + step, :bs],
                req_pool_indices=torch.full((bs,), self.pad_row, dtype=torch.int64),
                req_to_token=self.req_to_token.table,
                seq_lens=[1] * bs,
                extend_lens=[1] * bs,
                num_decode=bs,
                logits_indices=self.logits_indices[:bs],
                kv_pool=self.kv_pool,
                req_to_token_pool=self.req_to_token,
            )
            self.attention.prepare_decode_graph(self.meta[0, :bs], self.meta[1, :bs] + step)
            ids = self.model.forward(batch).argmax(dim=-1)
            if step:
                self.out[step - 1, :bs].copy_(ids)

    def _capture(self, bs: int, refresh: bool, pool: Any) -> torch.cuda.CUDAGraph:
        from radixserve.plugins.hardware.cuda_graph import capture_graph

        return capture_graph(lambda: self._chain(bs, refresh), pool)[0]

    def fits(self, num_reqs: int) -> bool:
        return num_reqs <= self.max_bs

    def launch(self, reqs: Sequence[Req], refresh: bool) -> torch.Tensor:
        """Queue the drafting of k greedy tokens per request; return them on the device,
        [len(reqs), k]. Each request feeds its last token at position ``req.kv_len`` (and, with
        ``refresh``, the one before it first); the draft KV must hold every position before
        the first fed, and the slots of positions kv_len .. kv_len + k - 1 must be allocated."""
        bs = len(reqs)
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        pad = [0] * (self.max_bs - bs)
        table = self.req_to_token.table
        # Plain lists, one tensor built at the end: a proposal's host time is the GPU's idle
        # time at batch 1 (the previous verify is done, this chain not yet queued).
        tails = [token_slice(r.input_ids, r.output_ids, r.kv_len - 1, 2) for r in reqs]
        slots = [table[r.req_pool_idx, r.kv_len - 1 : r.kv_len + self.k].tolist() for r in reqs]
        host = [
            [t[0] for t in tails] + pad,
            [t[1] for t in tails] + pad,
            [r.kv_len - 1 for r in reqs] + pad,
            *(list(step) + pad for step in zip(*slots, strict=True)),
            [r.req_pool_idx for r in reqs] + [self.pad_row] * len(pad),
            [r.kv_len for r in reqs] + [1] * len(pad),
        ]
        stage(self.staged, host, self.req_to_token)
        self.meta.copy_(self.staged[4 + self.k :])
        self.graphs[padded, refresh].replay()
        self.replays += 1
        self.refreshes += refresh
        # A copy: the next replay overwrites ``out`` while these may still wait to be read.
        return self.out[:, :bs].T.clone()


def graphs_capturable(
    context: Any, attention: Any = None, *, decode: bool = False, verify: bool = False
) -> bool:
    """Whether a drafter's steps can be captured in CUDA graphs: a CUDA device, graphs not
    turned off, and an attention backend that declares it prepares the steps the drafter
    runs from device tensors (``decode``: ``prepares_decode_on_device``; ``verify``:
    ``prepares_verify_on_device``; core/interfaces.py)."""
    return (
        context.device.startswith("cuda")
        and not context.config.disable_cuda_graph
        and (not decode or attention.prepares_decode_on_device)
        and (not verify or attention.prepares_verify_on_device)
    )


def stage(staged: torch.Tensor, host: list[list[int]], req_to_token: ReqToTokenPool) -> None:
    """Copy a proposal's ``host`` rows into the graph's input buffer ``staged`` in one copy,
    after the slot table's device mirror is current."""
    rows = torch.tensor(host, dtype=torch.int64)
    req_to_token.sync()
    if staged.device.type != "cpu":
        rows = rows.pin_memory()  # pinned: the copy does not wait on the GPU
    staged.copy_(rows, non_blocking=True)
