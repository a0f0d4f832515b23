"""CUDA graphs for decode steps: one graph per padded batch size, captured at start-up.

A captured step covers the attention backend's device-only decode preparation
(``prepare_decode_graph``) and the whole model forward, so a decode step costs one graph launch
plus a few small copies into the static inputs. The graphs read the req->token pool's device
mirror, a tensor allocated once; the model runner brings it up to date before each step. A batch of
``bs`` decodes replays the graph of the smallest captured size >= bs; padding rows read the
mirror's padding row (all slot 0, the KV pool's padding slot) and write their K/V to slot 0,
which no request owns.
Other batches (prefill chunks, larger batches, input logprobs) run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Protocol

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.memory import ReqToTokenPool

logger = logging.getLogger(__name__)


class GraphableAttention(Protocol):
    def bind_table(self, pool: ReqToTokenPool) -> int: ...

    def prepare(self, batch: ForwardBatch) -> None: ...

    def prepare_decode_graph(self, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> None: ...


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256, every 32 beyond, and max_bs itself."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16))
    sizes += list(range(288, max_bs + 1, 32))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(
        self,
        model: Any,
        attention: GraphableAttention,
        kv_pool: Any,
        req_to_token: ReqToTokenPool,
        max_bs: int,
        device: str,
    ) -> None:
        self.model, self.attention = model, attention
        self.max_bs = max_bs
        self.sizes = capture_sizes(max_bs)
        self.pad_row = attention.bind_table(req_to_token)
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, **long)  # type: ignore[arg-type]
        self.positions = torch.zeros(max_bs, **long)  # type: ignore[arg-type]
        self.out_cache_loc = torch.zeros(max_bs, **long)  # type: ignore[arg-type]
        self.logits_indices = torch.arange(max_bs, **long)  # type: ignore[arg-type]
        # [request rows | sequence lengths], filled by one host->device copy per step
        self.meta = torch.zeros(2, max_bs, dtype=torch.int32, device=device)
        self.meta[0].fill_(self.pad_row)
        self.meta[1].fill_(1)
        self._req_to_token = req_to_token
        self._kv_pool = kv_pool
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.graphs[bs] = self._capture(bs, pool)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=torch.full((bs,), self.pad_row, dtype=torch.int64),
            req_to_token=self._req_to_token.table,
            seq_lens=[1] * bs,
            extend_lens=[1] * bs,
            num_decode=bs,
            logits_indices=self.logits_indices[:bs],
            kv_pool=self._kv_pool,
            req_to_token_pool=self._req_to_token,
        )

    def _run_static(self, bs: int, batch: ForwardBatch) -> torch.Tensor:
        meta = self.meta[:, :bs]
        self.attention.prepare_decode_graph(meta[0], meta[1])
        return self.model.forward(batch)

    def _capture(self, bs: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._static_batch(bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles kernels, settles the allocator
            for _ in range(2):
                self._run_static(bs, batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._run_static(bs, batch)
        return graph, logits

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        if batch.num_decode != bs or bs > self.max_bs or batch.logits_indices.numel() != bs:
            self.attention.prepare(batch)
            return self.model.forward(batch)
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        pad = padded - bs
        fill = self.max_bs - bs
        rows = batch.req_pool_indices.tolist() + [self.pad_row] * fill
        host = torch.tensor([rows, batch.seq_lens + [1] * fill], dtype=torch.int32)
        self.meta.copy_(host.pin_memory(), non_blocking=True)  # pinned: no wait on the GPU
        for static, src in (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.out_cache_loc, batch.out_cache_loc),
        ):
            static[:bs].copy_(src)
            if pad:
                static[bs:padded].zero_()
        graph, logits = self.graphs[padded]
        graph.replay()
        return logits[:bs]
