"""torch_native attention: the reference backend for CPU and GPU.

Decodes are attended in one batched SDPA call over KV gathered to the longest sequence (masked);
prefill chunks run one SDPA call per request with a causal mask offset by the cached prefix.
Index tensors are built once per step in ``prepare`` and reused by every layer. KV is gathered
with ``index_select`` (about 3x faster than advanced indexing on CPU) and query heads are grouped
by their KV head, so GQA never repeats K/V in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.memory import KVPool


@dataclass(slots=True)
class _Extend:
    start: int  # first row of this request in the flattened new tokens
    end: int
    kv_slots: torch.Tensor  # [seq_len]
    mask: torch.Tensor | None  # [new, seq_len] bool, None when there is no cached prefix


class TorchNativeAttention(AttentionBackend):
    def __init__(self, kv_pool: KVPool, model_config: ModelConfig, device: str) -> None:
        self.kv_pool = kv_pool
        self.scale = model_config.head_dim**-0.5
        self.device = device
        self.num_kv_heads = model_config.num_kv_heads
        self.group = model_config.num_heads // model_config.num_kv_heads
        self._decode_slots: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._extends: list[_Extend] = []

    def prepare(self, batch: ForwardBatch) -> None:
        nd = batch.num_decode
        rows = batch.req_pool_indices
        self._decode_slots = self._decode_mask = None
        if nd:
            lens = batch.seq_lens[:nd]
            max_len = max(lens)
            self._decode_slots = batch.req_to_token[rows[:nd], :max_len].flatten().to(self.device)
            lens_t = torch.tensor(lens, device=self.device)
            mask = torch.arange(max_len, device=self.device)[None, :] < lens_t[:, None]
            self._decode_mask = mask[:, None, None, :]
        self._extends = []
        start = nd
        for i in range(nd, batch.batch_size):
            new, total = batch.extend_lens[i], batch.seq_lens[i]
            prefix = total - new
            mask = None
            if prefix:
                q_pos = torch.arange(prefix, total, device=self.device)[:, None]
                mask = torch.arange(total, device=self.device)[None, :] <= q_pos
            slots = batch.req_to_token[rows[i], :total].to(self.device)
            self._extends.append(_Extend(start, start + new, slots, mask))
            start += new

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        pool = self.kv_pool
        pool.store(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.k[layer_id], pool.v[layer_id]
        out = torch.empty_like(q)
        nd = batch.num_decode
        if nd:
            assert self._decode_slots is not None
            kvh, d = self.num_kv_heads, q.shape[-1]
            kd = k_buf.index_select(0, self._decode_slots).view(nd, -1, kvh, d).transpose(1, 2)
            vd = v_buf.index_select(0, self._decode_slots).view(nd, -1, kvh, d).transpose(1, 2)
            # [B, H, d] -> [B, kvh, group, d]: HF's GQA maps query head h to KV head h // group
            qd = q[:nd].view(nd, kvh, self.group, d)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=self._decode_mask, scale=self.scale
            )
            out[:nd] = od.reshape(nd, -1, d)
        for ext in self._extends:
            qe = q[ext.start : ext.end].transpose(0, 1)  # [H, n, d]
            ke = k_buf.index_select(0, ext.kv_slots).transpose(0, 1)  # [kvh, L, d]
            ve = v_buf.index_select(0, ext.kv_slots).transpose(0, 1)
            oe = F.scaled_dot_product_attention(
                qe,
                ke,
                ve,
                attn_mask=ext.mask,
                is_causal=ext.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[ext.start : ext.end] = oe.transpose(0, 1)
        return out.flatten(1)


@hookimpl
def register_attention_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "torch_native",
        TorchNativeAttention,
        description="reference paged attention with torch SDPA (CPU and GPU)",
    )
