"""CUDA graphs for decode steps: one graph per padded batch size, captured at start-up.

A captured step covers the attention backend's device-only decode preparation
(``prepare_decode_graph``) and the whole model forward, so a decode step costs one graph launch
plus a few small copies into the static inputs. The graphs read the req->token pool's device
mirror, a tensor allocated once; the model runner brings it up to date before each step. A batch of
``bs`` decodes replays the graph of the smallest captured size >= bs; padding rows read the
mirror's padding row (all slot 0, the KV pool's padding slot) and write their K/V to slot 0,
which no request owns.

Speculative decoding adds verify graphs: a batch of ``bs`` requests that each verify the same
number ``q`` of tokens (the last one plus q - 1 drafts) replays the graph captured for
(padded bs, q); padding requests verify q tokens at positions 0..q-1 of the padding row.
Steps of prefill chunks alone (up to 4 requests and ``prefill_tokens`` new tokens, no input
logprobs) replay prefill graphs, padded as ``prefill_graph.PaddedPrefill`` describes, where the
attention backend can prepare them from device tensors (``prepare_extend_graph``). Other
batches (longer prefills, prefill mixed with decodes, larger batches, input logprobs, uneven
drafts) run eagerly.
A speculative plugin that drafts from the target's hidden states (EAGLE, EAGLE-3, DFlash) gets
graphs captured again that also keep those layers' outputs (``keep_hidden_layers``).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.memory import ReqToTokenPool
from radixserve.plugins.hardware.prefill_graph import PaddedPrefill, Shape

logger = logging.getLogger(__name__)
T = TypeVar("T")


class GraphableAttention(Protocol):
    def bind_table(self, pool: ReqToTokenPool) -> int: ...

    def prepare(self, batch: ForwardBatch) -> None: ...

    def prepare_decode_graph(self, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> None: ...

    def prepare_verify_graph(
        self, req_rows: torch.Tensor, seq_lens: torch.Tensor, q_len: int
    ) -> None: ...


def capture_graph(run: Callable[[], T], pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture ``run`` into a CUDA graph in the memory ``pool``, after two warm-up calls on a
    side stream (they compile the kernels and settle the allocator). Returns the graph and
    what the captured call returned (static outputs the replays rewrite)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


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
        verify_shapes: dict[int, int] | None = None,
        prefill_tokens: int = 0,
    ) -> None:
        """``prefill_tokens``: the most new tokens a prefill graph takes (0: none)."""
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
        # Target layers whose outputs every graph also keeps (``keep_hidden_layers``), and
        # those static outputs per graph: {batch size: {layer: [rows, hidden]}}.
        self.capture_layers: tuple[int, ...] = ()
        # The speculative plugin's ``target_hidden``, run inside every graph when it is
        # capturable (its feature writes then cost no launches of their own).
        self.hidden_consumer: Callable[[ForwardBatch], None] | None = None
        self.hidden_out: dict[int, dict[int, torch.Tensor]] = {}
        self.v_hidden_out: dict[int, dict[int, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # Verify graphs: {padded batch size: tokens per request}.
        self.verify_shapes = dict(verify_shapes or {})
        if self.verify_shapes and not attention.prepares_verify_on_device:
            logger.info("no verify graphs: attention %s cannot prepare them", type(attention))
            self.verify_shapes = {}
        most = max((b * q for b, q in self.verify_shapes.items()), default=0)
        self.v_input_ids = torch.zeros(most, **long)  # type: ignore[arg-type]
        self.v_positions = torch.zeros(most, **long)  # type: ignore[arg-type]
        self.v_out_cache_loc = torch.zeros(most, **long)  # type: ignore[arg-type]
        self.v_logits_indices = torch.arange(most, **long)  # type: ignore[arg-type]
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_replays = 0  # verify steps served from a graph (tests read it)
        self.prefill: PaddedPrefill | None = None
        if prefill_tokens > 0 and attention.prepares_extend_on_device:
            self.prefill = PaddedPrefill(
                model, attention, kv_pool, req_to_token, self.pad_row, prefill_tokens, device
            )  # type: ignore[arg-type]
        self.prefill_graphs: dict[Shape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.p_hidden_out: dict[Shape, dict[int, torch.Tensor]] = {}
        self.prefill_replays = 0  # prefill steps served from a graph (tests read it)
        self._capture_all()
        # the scheduler pads drafts to one length so that verify steps replay these graphs
        self.uniform_verify = bool(self.verify_graphs)

    def _capture_all(self) -> None:
        if self.prefill is not None:
            for shape in self.prefill.shapes:
                self.prefill_graphs[shape] = self._capture_prefill(shape, self._pool)
            logger.info("captured prefill graphs (requests, tokens) %s", self.prefill.shapes)
        for bs in sorted(self.verify_shapes, reverse=True):
            self.verify_graphs[bs] = self._capture_verify(bs, self.verify_shapes[bs], self._pool)
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.graphs[bs] = self._capture(bs, self._pool)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)
        if self.verify_shapes:
            logger.info("captured verify graphs (batch size: tokens) %s", self.verify_shapes)
        if self.capture_layers:
            logger.info("the graphs keep the outputs of layers %s", self.capture_layers)

    def keep_hidden_layers(
        self, layers: tuple[int, ...], consumer: Callable[[ForwardBatch], None] | None = None
    ) -> None:
        """Capture the graphs again so that each also keeps these layers' outputs (a
        speculative plugin that drafts from the target's hidden states needs them after every
        forward); until then such forwards run eagerly. Called once, after the plugin's setup,
        which comes after the graphs' first capture. ``consumer`` (the plugin's
        ``target_hidden``, where capturable) is captured at the end of every graph: eagerly,
        its launches came on top of every decode step (DFlash's context projection: 1.45 ms
        a step against 1.0 on the H200 with the default model; bench/HISTORY.md)."""
        layers = tuple(layers)
        if (layers, consumer) == (self.capture_layers, self.hidden_consumer) or self.max_bs == 0:
            return
        torch.cuda.synchronize()
        self._reset_graphs()
        # a new memory pool: the old one went with its last graph
        self._pool = torch.cuda.graph_pool_handle()
        self.capture_layers = layers
        self.hidden_consumer = consumer
        self._capture_all()

    def _reset_graphs(self) -> None:
        every = [*self.graphs.values(), *self.verify_graphs.values(), *self.prefill_graphs.values()]
        for graph, _ in every:
            graph.reset()
        for kept in (self.graphs, self.verify_graphs, self.prefill_graphs, self.hidden_out,
                     self.v_hidden_out, self.p_hidden_out):  # fmt: skip
            kept.clear()

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
            capture_hidden_layers=self.capture_layers,
        )

    def _run_static(self, bs: int, batch: ForwardBatch) -> torch.Tensor:
        meta = self.meta[:, :bs]
        self.attention.prepare_decode_graph(meta[0], meta[1])
        return self._forward_and_consume(batch)

    def _forward_and_consume(self, batch: ForwardBatch) -> torch.Tensor:
        logits = self.model.forward(batch)
        if self.hidden_consumer is not None and batch.capture_hidden_layers:
            self.hidden_consumer(batch)
        return logits

    def _capture(self, bs: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._static_batch(bs)
        self._plan(bs, [self.pad_row] * bs, [1] * bs)
        captured = capture_graph(lambda: self._run_static(bs, batch), pool)
        self.hidden_out[bs] = batch.hidden_states or {}
        return captured

    def _plan(self, bs: int, rows: list[int], seq_lens: list[int]) -> None:
        """Backends whose per-step setup runs on the host (FlashInfer's ``plan``) do it here,
        outside the graph, before the capture of size ``bs`` and before each of its replays."""
        plan = getattr(self.attention, "plan_decode_graph", None)
        if plan is not None:
            plan(bs, rows, seq_lens)

    def _capture_verify(
        self, bs: int, q: int, pool: Any
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        n = bs * q
        batch = ForwardBatch(
            input_ids=self.v_input_ids[:n],
            positions=self.v_positions[:n],
            out_cache_loc=self.v_out_cache_loc[:n],
            req_pool_indices=torch.full((bs,), self.pad_row, dtype=torch.int64),
            req_to_token=self._req_to_token.table,
            seq_lens=[q] * bs,
            extend_lens=[q] * bs,
            num_decode=0,
            logits_indices=self.v_logits_indices[:n],
            kv_pool=self._kv_pool,
            req_to_token_pool=self._req_to_token,
            capture_hidden_layers=self.capture_layers,
        )
        meta = self.meta[:, :bs]
        meta[1, :bs].fill_(q)

        def run() -> torch.Tensor:
            self.attention.prepare_verify_graph(meta[0], meta[1], q)  # type: ignore[attr-defined]
            return self._forward_and_consume(batch)

        captured = capture_graph(run, pool)
        self.meta[1].fill_(1)
        self.v_hidden_out[bs] = batch.hidden_states or {}
        return captured

    def _capture_prefill(
        self, shape: Shape, pool: Any
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        assert self.prefill is not None
        prefill = self.prefill
        batch = prefill.static_batch(shape, self.capture_layers)
        prefill.reset(shape)

        def run() -> torch.Tensor:
            prefill.prepare(shape)
            return self._forward_and_consume(batch)

        captured = capture_graph(run, pool)
        self.p_hidden_out[shape] = batch.hidden_states or {}
        return captured

    def _replay_prefill(self, batch: ForwardBatch) -> torch.Tensor | None:
        prefill = self.prefill
        shape = prefill.shape_for(batch) if prefill is not None else None
        if prefill is None or shape is None or shape not in self.prefill_graphs:
            return None
        prefill.fill(batch, shape)
        graph, logits = self.prefill_graphs[shape]
        self._replay(graph)
        self.prefill_replays += 1
        self._hand_hidden(batch, self.p_hidden_out[shape], batch.num_tokens)
        return logits[: batch.batch_size]

    def _replay_verify(self, batch: ForwardBatch, q: int) -> torch.Tensor | None:
        bs = batch.batch_size
        fits = [b for b, bq in self.verify_shapes.items() if b >= bs and bq == q]
        if not fits or batch.logits_indices.numel() != bs * q:
            return None
        padded = min(fits)
        fill = self.max_bs - bs
        rows = batch.req_pool_indices.tolist() + [self.pad_row] * fill
        host = torch.tensor([rows, batch.seq_lens + [q] * fill], dtype=torch.int32)
        self.meta.copy_(host.pin_memory(), non_blocking=True)
        n, total = bs * q, padded * q
        self.v_input_ids[:n].copy_(batch.input_ids)
        self.v_out_cache_loc[:n].copy_(batch.out_cache_loc)
        self.v_positions[:n].copy_(batch.positions)
        if total > n:  # padding requests: positions 0..q-1 of the padding row, slot 0
            self.v_input_ids[n:total].zero_()
            self.v_out_cache_loc[n:total].zero_()
            self.v_positions[n:total].copy_(
                torch.arange(q, device=self.v_positions.device).repeat(padded - bs)
            )
        graph, logits = self.verify_graphs[padded]
        self._replay(graph)
        self.verify_replays += 1
        self._hand_hidden(batch, self.v_hidden_out[padded], n)
        return logits[:n]

    def _replay(self, graph: torch.cuda.CUDAGraph) -> None:
        # a graph cannot wait for HiCache's loads layer by layer (KVPool.wait_layer): for all
        self._kv_pool.wait_loads()
        graph.replay()

    def _hand_hidden(self, batch: ForwardBatch, kept: dict[int, torch.Tensor], rows: int) -> None:
        """The replayed graph's kept layer outputs, as an eager forward leaves them; or, where
        the graph ran the consumer itself, that it did."""
        if not batch.capture_hidden_layers:
            return
        if self.hidden_consumer is not None:
            batch.hidden_consumed = True
            return
        batch.hidden_states = {i: h[:rows] for i, h in kept.items()}

    def release(self) -> None:
        """Free every captured graph now (the engine is shutting down). Graphs that captured
        collectives must go before the tensor-parallel group does: destroying a communicator
        that live graphs still reference hangs (pytorch issue 115388)."""
        torch.cuda.synchronize()  # no replay may still be running on the device
        self._reset_graphs()
        # the consumer is a method of the speculative plugin: holding it would keep the
        # plugin's feature pool and draft KV on the device after the engine shut down
        self.hidden_consumer = None
        self.verify_shapes = {}
        self.prefill = None
        self.max_bs = 0  # every later batch runs eagerly

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        wanted = tuple(batch.capture_hidden_layers)
        if (
            batch.hidden_rows is not None
            or (wanted and wanted != self.capture_layers)
            or batch.mm is not None
        ):
            # the graphs keep no such hidden states, nor a step's image embeddings or M-RoPE
            # positions (core/multimodal_strategy.py): run eagerly
            self.attention.prepare(batch)
            return self.model.forward(batch)
        if batch.num_decode == 0 and self.verify_shapes:
            q = batch.extend_lens[0]
            if q > 1 and all(n == q for n in batch.extend_lens):
                logits = self._replay_verify(batch, q)
                if logits is not None:
                    return logits
        if batch.num_decode == 0:
            logits = self._replay_prefill(batch)
            if logits is not None:
                return logits
        if batch.num_decode != bs or bs > self.max_bs or batch.logits_indices.numel() != bs:
            self.attention.prepare(batch)
            return self.model.forward(batch)
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        pad = padded - bs
        fill = self.max_bs - bs
        rows = batch.req_pool_indices.tolist() + [self.pad_row] * fill
        lens = batch.seq_lens + [1] * fill
        host = torch.tensor([rows, lens], dtype=torch.int32)
        self.meta.copy_(host.pin_memory(), non_blocking=True)  # pinned: no wait on the GPU
        for static, src in (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.out_cache_loc, batch.out_cache_loc),
        ):
            static[:bs].copy_(src)
            if pad:
                static[bs:padded].zero_()
        self._plan(padded, rows[:padded], lens[:padded])
        graph, logits = self.graphs[padded]
        self._replay(graph)
        self._hand_hidden(batch, self.hidden_out[padded], bs)
        return logits[:bs]
