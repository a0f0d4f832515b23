"""The ``flashinfer`` attention backend: FlashInfer's paged wrappers over the shared KV pool.

Per step, ``prepare`` describes the batch as pages (indices.py) and plans one wrapper, which every
layer then runs: a decode-only batch goes to ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores
where the GQA group is 4 or more, where they pay), any batch with a prefill chunk, decodes
included, to ``BatchPrefillWithPagedKVCacheWrapper`` with a causal mask. ``forward`` stores the
new K/V first, so a chunk attends over its whole paged sequence, cached prefix and itself.

The pool's per-layer buffers [slots, kv_heads, dim] are viewed as [pages, page_size, kv_heads,
dim] (FlashInfer's NHD layout); page 0, like slot 0, is padding.

CUDA graphs: FlashInfer's ``plan`` runs on the host and cannot be captured. The graph runner calls
``plan_decode_graph`` before capturing a batch size and before every replay; each captured size
has its own wrapper with fixed index buffers, which ``plan`` refills. Inside the capture
``prepare_decode_graph`` only picks that wrapper.

Options FlashInfer would need per-layer plans for (sliding window, logit soft-capping, a score
scale of the model's own) are not parameters of ``forward``: a model that needs them stops at
build time with an error naming this backend (plugins/models/kernel_choice.py).
"""

from __future__ import annotations

from typing import Any

import flashinfer
import torch

from radixserve.core.batch import ForwardBatch, to_device
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.plugins.attention.flashinfer.indices import gather_page_indices, page_layout

# Split-K partial results of all wrappers (they run one after another on one stream); plan()
# fails when a step's partials do not fit. SGLang's default size.
WORKSPACE_BYTES = 384 << 20
# fa2 compiles in half the time of fa3 on first use (31 s against 60 s on the H200) and is
# what the decode wrapper's tensor-core path runs anyway: one compiled module serves both.
PREFILL_BACKEND = "fa2"
DTYPES = (torch.float16, torch.bfloat16)
# The head sizes FlashInfer ships kernels for (and this backend was checked with); others may
# fail deep inside its JIT compiler, so they stop here with a message instead.
HEAD_DIMS = (64, 128, 256)


class FlashInferAttention(AttentionBackend):
    # capabilities (core/interfaces.py): prepare_decode_graph, and plan_decode_graph (host)
    prepares_decode_on_device = True
    plans_decode_on_host = True

    def __init__(
        self, kv_pool: KVPool, model_config: ModelConfig, device: str, page_size: int | None = None
    ) -> None:
        dtype = kv_pool.k[0].dtype
        if dtype not in DTYPES:
            raise ConfigError(
                f"attention=flashinfer runs float16 or bfloat16 KV, not {dtype}; "
                "use --dtype bfloat16, or --plugin attention=triton"
            )
        if model_config.head_dim not in HEAD_DIMS:
            raise ConfigError(
                f"attention=flashinfer supports head_dim {', '.join(map(str, HEAD_DIMS))}, not "
                f"{model_config.head_dim}; use --plugin attention=triton"
            )
        self.kv_pool = kv_pool
        self.dtype = dtype
        self.page_size = page_size or getattr(kv_pool, "page_size", 1)
        self.device = torch.device(device)
        self.num_heads = model_config.num_heads
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.scale = model_config.head_dim**-0.5
        self.tensor_cores = self.num_heads // self.num_kv_heads >= 4
        p = self.page_size
        pages = kv_pool.k[0].shape[0] // p
        view = (pages, p, self.num_kv_heads, self.head_dim)
        self.k_pages = [buf[: pages * p].view(view) for buf in kv_pool.k]
        self.v_pages = [buf[: pages * p].view(view) for buf in kv_pool.v]
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode = self._decode_wrapper()
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=PREFILL_BACKEND
        )
        self._graph_decode: dict[int, Any] = {}  # captured batch size -> its wrapper
        self._graph_indices: torch.Tensor | None = None  # page indices, shared by those
        self._planned: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> its last plan's copy
        self.table: torch.Tensor | None = None  # the pool's device mirror
        self._active: Any = None  # the wrapper that forward runs this step

    def _decode_wrapper(self, graph_bs: int = 0) -> Any:
        if not graph_bs:
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.tensor_cores
            )
        i32 = dict(dtype=torch.int32, device=self.device)
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(graph_bs + 1, **i32),  # type: ignore[arg-type]
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=torch.ones(graph_bs, **i32),  # type: ignore[arg-type]
        )  # fmt: skip

    def bind_table(self, pool: ReqToTokenPool) -> int:
        """Take the pool's device mirror (current as of now); return its padding row."""
        self.table = pool.device_table(self.device)
        return pool.pad_row

    # -- per-step planning ------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch) -> None:
        self.bind_table(batch.req_to_token_pool)
        rows = batch.req_pool_indices.tolist()
        if batch.num_decode == batch.batch_size:
            self._plan(self._decode, rows, batch.seq_lens)
            return
        qo_indptr = [0]
        for n in batch.extend_lens:
            qo_indptr.append(qo_indptr[-1] + n)
        self._plan(self._prefill, rows, batch.seq_lens, qo_indptr=qo_indptr)

    def plan_decode_graph(self, bs: int, req_rows: list[int], seq_lens: list[int]) -> None:
        """Plan the wrapper of captured batch size ``bs`` for the decode step about to be
        replayed (or captured): ``req_rows`` and ``seq_lens`` have ``bs`` entries, padding
        included. Runs on the host, outside the graph; reads the slot table's device mirror,
        which must be current (the model runner syncs it before every step)."""
        if self.table is None:
            raise RuntimeError("bind_table() must run before plan_decode_graph()")
        wrapper = self._graph_decode.get(bs)
        if wrapper is None:
            if self._graph_indices is None:
                # Enough pages for every table row at full length (shared prefixes repeat pages).
                rows, cols = self.table.shape
                per_row = -(-cols // self.page_size)
                self._graph_indices = torch.zeros(
                    rows * per_row, dtype=torch.int32, device=self.device
                )
            wrapper = self._graph_decode[bs] = self._decode_wrapper(bs)
        self._plan(wrapper, req_rows, seq_lens)

    def prepare_decode_graph(self, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Inside a capture: run the wrapper ``plan_decode_graph`` planned for this size."""
        bs = req_rows.shape[0]
        if bs not in self._graph_decode:
            raise RuntimeError(f"plan_decode_graph({bs}, ...) must run before capturing size {bs}")
        self._active = self._graph_decode[bs]

    def _plan(
        self,
        wrapper: Any,
        rows: list[int],
        seq_lens: list[int],
        qo_indptr: list[int] | None = None,
    ) -> None:
        assert self.table is not None
        layout = page_layout(seq_lens, self.page_size)
        packed = torch.tensor([rows, layout.pages, layout.indptr[:-1]], dtype=torch.int64)
        dev = to_device(packed, self.device)
        indices = gather_page_indices(
            self.table, dev[0], dev[1], dev[2], layout.indptr[-1], self.page_size
        )
        indptr, last = self._host(layout.indptr), self._host(layout.last_page_len)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        # NOTE: plan fills a pinned host buffer of the wrapper and copies it to the device
        # without waiting; the previous plan's copy from it may still be queued behind the
        # running step (overlap scheduling), so wait for that copy, not for the step.
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()
        options = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        if qo_indptr is None:
            wrapper.plan(indptr, indices, last, *heads, self.page_size, **options)
        else:
            qo = self._host(qo_indptr)
            wrapper.plan(qo, indptr, indices, last, *heads, self.page_size, causal=True, **options)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._planned[id(wrapper)] = event
        self._active = wrapper

    def _host(self, values: list[int]) -> torch.Tensor:
        """An int32 host tensor for ``plan``, which reads it on the host and copies it to the
        device: pinned, so the copy does not wait for the device."""
        host = torch.tensor(values, dtype=torch.int32)
        return host.pin_memory() if self.device.type == "cuda" else host

    # -- the layer call ---------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        assert self._active is not None, "prepare() must run before forward()"
        self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        out = self._active.run(q.contiguous(), (self.k_pages[layer_id], self.v_pages[layer_id]))
        return out.view(q.shape[0], -1)
