"""The ``triton`` attention backend: paged KV (any power-of-two page size) with GQA on the GPU.

Per step, ``prepare`` builds the metadata every layer reuses with one host->device copy (request
rows, sequence lengths, new-token counts and offsets); ``forward`` stores the new K/V with one
launch, then runs the decode kernel on the decode rows and the extend kernel on the prefill
chunks. Kernels read KV slots from the req->token pool's device mirror, which the pool keeps
current (core/memory.py); this backend keeps no copy of its own.

The page size comes from the ``page_size`` argument or else the KV pool's ``page_size``
attribute (1 when it has none). With P > 1 the kernels read one table entry per page: a
request's positions [k * P, (k + 1) * P) sit in consecutive slots (see core/memory.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from radixserve.core.batch import ForwardBatch, to_device
from radixserve.core.config import ModelConfig
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.plugins.attention.triton.decode_kernel import (
    decode_attention,
    decode_config,
    merges_in_launch,
    new_counters,
    num_decode_splits,
)
from radixserve.plugins.attention.triton.extend_kernel import extend_attention, extend_config
from radixserve.plugins.attention.triton.store_kernel import store_kv, store_kv_rotary


@dataclass(slots=True)
class StepMeta:
    num_decode: int
    req_rows: torch.Tensor  # [B] int32, device
    seq_lens: torch.Tensor  # [B] int32
    ext_lens: torch.Tensor  # [B] int32
    q_starts: torch.Tensor  # [B] int32, first flattened row of each request's new tokens
    max_ext_len: int  # longest prefill chunk (0 without one)
    part_out: torch.Tensor  # [num_decode, H, splits, D] float32 decode scratch
    part_lse: torch.Tensor  # [num_decode, H, splits] float32
    # [num_decode, KVH] int32 for the decode splits' merge in their launch (None: a second
    # kernel merges them)
    counters: torch.Tensor | None


class TritonAttention(AttentionBackend):
    # capabilities (core/interfaces.py): prepare_decode_graph and prepare_verify_graph
    prepares_decode_on_device = True
    prepares_verify_on_device = True
    prepares_extend_on_device = True

    def __init__(
        self, kv_pool: KVPool, model_config: ModelConfig, device: str, page_size: int | None = None
    ) -> None:
        self.kv_pool = kv_pool
        # an FP8 cache (--kv-cache-dtype fp8_e4m3): the kernels widen K/V to the queries'
        # dtype and apply the layer's scales; any other cache must be the model's dtype
        self.reads_other_kv_dtype = getattr(kv_pool, "saturate", False)
        self.page_size = page_size or getattr(kv_pool, "page_size", 1)
        self.device = torch.device(device)
        self.num_heads = model_config.num_heads
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.scale = model_config.head_dim**-0.5
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 4
        self.table: torch.Tensor | None = None  # the pool's device mirror (+ 1 padding row)
        # Decode splits merged in their own launch, by the last split of each group; "kernel":
        # by a second kernel (RADIXSERVE_TRITON_SPLIT_MERGE, for comparison)
        self.merge_in_launch = os.environ.get("RADIXSERVE_TRITON_SPLIT_MERGE") != "kernel"
        # Decode launch settings over decode_kernel.GPU_CONFIG ("block_n=64,splits=2": A-B runs)
        self.decode_config = decode_config(os.environ.get("RADIXSERVE_TRITON_DECODE"))
        self.extend_config = extend_config(os.environ.get("RADIXSERVE_TRITON_EXTEND"))
        self._meta: StepMeta | None = None
        self._invariant = False  # set_batch_invariant

    def set_batch_invariant(self) -> None:
        """--enable-deterministic-inference (core/deterministic.py): every row (decode,
        verify, prefill) through the extend kernel, whose loop reads keys in blocks of
        ``block_n`` positions from position 0 and merges them in order, one row's blocks the
        same whatever else the launch holds; the unmasked pass off (its split point depends on
        the query block); a KV head's query heads in one program (``pack_gqa``: a decode row
        reads its K/V once for the group, as the split-K decode kernel does). The split-K
        decode kernel is not used: its split count follows the batch size. Decode, verify and
        prefill graphs still capture (a decode row is an extend of one token)."""
        self._invariant = True
        self.extend_config = {**self.extend_config, "split_mask": False}

    def bind_table(self, pool: ReqToTokenPool) -> int:
        """Take the pool's device mirror (current as of now); return its padding row."""
        self.table = pool.device_table(self.device)
        return pool.pad_row

    def prepare(self, batch: ForwardBatch) -> None:
        self.bind_table(batch.req_to_token_pool)
        nd, bs = batch.num_decode, batch.batch_size
        rows = batch.req_pool_indices.tolist()
        starts, total = [], 0
        for n in batch.extend_lens:
            starts.append(total)
            total += n
        packed = torch.tensor(rows + batch.seq_lens + batch.extend_lens + starts, dtype=torch.int32)
        dev = to_device(packed, self.device).view(4, bs)
        self._meta = self._step_meta(nd, dev, max(batch.extend_lens[nd:], default=0))

    def prepare_decode_graph(self, req_rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Decode-only ``prepare`` from device tensors alone, so it can be captured in a CUDA
        graph together with the model: every buffer it uses is fixed by the batch size."""
        bs = req_rows.shape[0]
        ones = torch.ones_like(seq_lens)
        dev = torch.stack([req_rows, seq_lens, ones, torch.cumsum(ones, 0) - 1])
        self._meta = self._step_meta(bs, dev, 0)

    def prepare_verify_graph(
        self, req_rows: torch.Tensor, seq_lens: torch.Tensor, q_len: int
    ) -> None:
        """``prepare`` for a verify step (every request extends by ``q_len`` tokens) from
        device tensors alone, for capture in a CUDA graph.

        Each verify token attends as a decode whose sequence ends at itself (its K/V and those
        of the tokens before it are stored first): the split-K decode kernel spreads a small
        batch over the whole GPU, where the extend kernel would run one program per (request,
        head)."""
        offsets = torch.arange(q_len, device=seq_lens.device, dtype=seq_lens.dtype) - (q_len - 1)
        rows = req_rows.repeat_interleave(q_len)
        lens = (seq_lens[:, None] + offsets[None, :]).flatten()
        ones = torch.ones_like(lens)
        dev = torch.stack([rows, lens, ones, torch.cumsum(ones, 0) - 1])
        self._meta = self._step_meta(rows.shape[0], dev, 0)

    def prepare_extend_graph(self, meta: torch.Tensor, max_ext_len: int) -> None:
        """``prepare`` for a step of prefill chunks alone, from the device tensor ``meta``
        [4, R] int32 (request rows, sequence lengths, new tokens, first flattened rows), for
        capture in a CUDA graph: the grid fits ``max_ext_len`` new tokens a request, and a
        request's query blocks past its own new tokens do no work."""
        self._meta = self._step_meta(0, meta, max_ext_len)

    def _step_meta(self, nd: int, dev: torch.Tensor, max_ext_len: int) -> StepMeta:
        if self._invariant and nd:  # decode rows as extends of one token (set_batch_invariant)
            nd, max_ext_len = 0, max(max_ext_len, 1)
        splits = num_decode_splits(nd, self.num_kv_heads, self.num_sms, self.decode_config)
        shape = (nd, self.num_heads, splits)
        counters = None
        if self.merge_in_launch and merges_in_launch(splits):
            counters = new_counters(nd, self.num_kv_heads, self.device)
        return StepMeta(
            num_decode=nd,
            req_rows=dev[0],
            seq_lens=dev[1],
            ext_lens=dev[2],
            q_starts=dev[3],
            max_ext_len=max_ext_len,
            part_out=torch.empty((*shape, self.head_dim), dtype=torch.float32, device=self.device),
            part_lse=torch.empty(shape, dtype=torch.float32, device=self.device),
            counters=counters,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        *,
        sliding_window: int = 0,
        logit_softcap: float = 0.0,
        scale: float | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The AttentionBackend call; the keywords are per-layer options (Gemma 2 style models):
        a sliding window of W keys (0: none), score soft-capping c * tanh(s / c) (0: none) and
        the score scale (None: head_dim ** -0.5). ``rotary``: (positions, cos, sin) when q and
        k come unrotated; the K/V store rotates them (rotate-half RoPE) in its launch."""
        meta, table = self._meta, self.table
        scale = self.scale if scale is None else scale
        options = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
        assert meta is not None and table is not None, "prepare() must run before forward()"
        k_buf, v_buf = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        k_scale, v_scale = self._kv_scales(layer_id)
        if rotary is None:
            store_kv(k, v, k_buf, v_buf, batch.out_cache_loc, k_scale, v_scale)
        else:
            q = store_kv_rotary(
                q, k, v, k_buf, v_buf, batch.out_cache_loc, *rotary, k_scale, v_scale
            )
        scale *= k_scale  # an FP8 cache's K scale folds into the scores' (1.0 otherwise)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            decode_attention(
                q[:nd], k_buf, v_buf, table, meta.req_rows[:nd], meta.seq_lens[:nd],
                out[:nd], meta.part_out, meta.part_lse, scale, page_size=self.page_size,
                counters=meta.counters, config=self.decode_config, **options,
            )  # fmt: skip
        if meta.max_ext_len:
            extend_attention(
                q, k_buf, v_buf, out, table, meta.req_rows[nd:], meta.seq_lens[nd:],
                meta.ext_lens[nd:], meta.q_starts[nd:], meta.max_ext_len, scale,
                page_size=self.page_size, config=self.extend_config,
                split_mask=False if self._invariant else None, pack_gqa=self._invariant,
                **options,
            )  # fmt: skip
        if v_scale != 1.0:  # the output is linear in V: scale it once
            out.mul_(v_scale)
        return out.flatten(1)

    def _kv_scales(self, layer_id: int) -> tuple[float, float]:
        """An FP8 cache's (k_scale, v_scale) for the layer (stores divide by them, reads
        multiply); (1.0, 1.0) for any other cache."""
        if not getattr(self.kv_pool, "saturate", False):
            return 1.0, 1.0
        return self.kv_pool.k_scales[layer_id], self.kv_pool.v_scales[layer_id]
