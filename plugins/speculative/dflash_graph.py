"""DFlash's block forward from CUDA graphs, one per (padded requests, context width).

Eagerly, a proposal gathers each request's context K/V, builds the mask and runs the
drafter's block forward: a few dozen launches from Python for a one-layer drafter, which on a
GPU cost more host time than the device needs. A graph needs fixed shapes, so the context
width is padded: the requests' slots are read from the slot table's device mirror up to the
smallest captured width (64, 128, ... up to the context length or MAX_GRAPH_WIDTH) that holds
the longest context; positions past a request's own context are masked, as the eager batch
masks its shorter contexts. Padding requests (the table's padding row, context length 0) see
only their own block. A proposal costs one host-to-device copy (table rows, context lengths,
last tokens) and a replay; the drafts stay on the device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.core.memory import ReqToTokenPool
from radixserve.core.request import Req, token_slice
from radixserve.plugins.speculative.draft_chain import stage

MIN_GRAPH_WIDTH = 64
#: Longer contexts run eagerly: a graph holds its gathered context K/V (a [requests, width,
#: KV heads, head size] copy a layer) and its scores, sized by the width.
MAX_GRAPH_WIDTH = 4096


def context_widths(max_context: int) -> list[int]:
    """64, 128, ... doubling, then the cap: min(max_context, MAX_GRAPH_WIDTH)."""
    top = min(max_context, MAX_GRAPH_WIDTH)
    widths, width = [], MIN_GRAPH_WIDTH
    while width < top:
        widths.append(width)
        width *= 2
    return widths + [top]


def block_inputs(reqs: Sequence[Req]) -> list[list[int]]:
    """[table rows, context lengths, last tokens] of a proposal's requests: a block starts at
    position kv_len with the token there (not yet verified)."""
    return [
        [r.req_pool_idx for r in reqs],  # type: ignore[misc]
        [r.kv_len for r in reqs],
        [token_slice(r.input_ids, r.output_ids, r.kv_len, 1)[0] for r in reqs],
    ]


class DFlashBlockGraphs:
    def __init__(
        self,
        drafter: Any,
        req_to_token: ReqToTokenPool,
        sizes: Sequence[int],
        max_context: int,
        device: str,
        capture: bool = True,
    ) -> None:
        """``drafter``: the DFlashDraft plugin after setup (its ``block``). Without
        ``capture`` no graph is captured and ``launch`` runs the same padded forward eagerly
        (the CPU, in tests)."""
        self.drafter = drafter
        self.req_to_token = req_to_token
        self.table = req_to_token.device_table(device)  # allocated once: graphs may read it
        self.sizes = sorted(sizes)
        self.widths = context_widths(max_context)
        self.replays = 0  # proposals served by a graph (tests read it)
        # [table rows | context lengths | last tokens], one column a request
        self.staged = torch.zeros(3, self.sizes[-1], dtype=torch.int64, device=device)
        self.staged[0].fill_(req_to_token.pad_row)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        if capture:
            from radixserve.plugins.hardware.cuda_graph import capture_graph

            pool = torch.cuda.graph_pool_handle()
            for width in reversed(self.widths):  # largest first: the rest reuse its memory
                for bs in reversed(self.sizes):
                    self.graphs[bs, width] = capture_graph(
                        lambda bs=bs, width=width: self._block(bs, width), pool
                    )

    def shape_for(self, reqs: Sequence[Req]) -> tuple[int, int] | None:
        """(padded requests, width) of the smallest graph that takes ``reqs``, or None."""
        longest = max(r.kv_len for r in reqs)
        if len(reqs) > self.sizes[-1] or longest > self.widths[-1]:
            return None
        bs = self.sizes[bisect.bisect_left(self.sizes, len(reqs))]
        return bs, self.widths[bisect.bisect_left(self.widths, longest)]

    def _block(self, bs: int, width: int) -> torch.Tensor:
        rows, lens, last = self.staged[:, :bs]
        return self.drafter.block(self.table[rows, :width].long(), lens, last)

    def launch(self, reqs: Sequence[Req], shape: tuple[int, int]) -> torch.Tensor:
        """The drafts [len(reqs), B - 1] of one block forward, on the device."""
        fill = self.staged.shape[1] - len(reqs)
        rows, lens, last = block_inputs(reqs)
        host = [rows + [self.req_to_token.pad_row] * fill, lens + [0] * fill, last + [0] * fill]
        stage(self.staged, host, self.req_to_token)
        if shape not in self.graphs:
            return self._block(*shape)[: len(reqs)]
        graph, drafts = self.graphs[shape]
        graph.replay()
        self.replays += 1
        return drafts[: len(reqs)]
