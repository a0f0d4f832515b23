"""A stand-in for the ``flashinfer`` package: the two paged wrappers the ``flashinfer`` attention
backend uses, computing in plain torch what FlashInfer documents, so the backend's planning runs
on a CPU machine (tests/plugins/attention/test_flashinfer_backend.py).

What it checks as FlashInfer does (or needs, to stay fast): int32 index tensors; ``indptr``,
``last_page_len`` and ``qo_indptr`` on the host (FlashInfer reads them there; device tensors would
cost a sync); in CUDA-graph mode a fixed batch size and indices that fit the fixed buffer, which
``run`` then reads (as a captured kernel would). Causal masks align the queries with the end of
their sequence.
"""

from __future__ import annotations

import torch


class _PagedWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 backend: str = "auto",
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:  # fmt: skip
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        self.indices_buf = paged_kv_indices_buffer
        if use_cuda_graph:
            assert paged_kv_indptr_buffer is not None and paged_kv_last_page_len_buffer is not None
            self.fixed_bs = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self.fixed_bs + 1
        self.plans = 0

    def _plan(self, qo, indptr, indices, last, heads, kv_heads, dim, page, causal, scale) -> None:  # noqa: ANN001
        for t in (qo, indptr, indices, last):
            assert t.dtype == torch.int32
        for t in (qo, indptr, last):
            assert t.device.type == "cpu", "FlashInfer reads this on the host"
        if self.graph:
            assert len(last) == self.fixed_bs, "the batch size is fixed in CUDA-graph mode"
            assert self.indices_buf is not None and len(indices) <= len(self.indices_buf)
            self.indices_buf[: len(indices)].copy_(indices)
            indices = self.indices_buf
        self.qo, self.indptr, self.last = qo.tolist(), indptr.tolist(), last.tolist()
        self.indices, self.page, self.causal, self.scale = indices, page, causal, scale
        self.shape = (heads, kv_heads, dim)
        self.plans += 1

    def run(
        self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache
        heads, kv_heads, dim = self.shape
        assert q.shape[1:] == (heads, dim) and k_cache.shape[1:] == (self.page, kv_heads, dim)
        out = torch.empty_like(q)
        for b in range(len(self.last)):
            pages = self.indices[self.indptr[b] : self.indptr[b + 1]].long()
            n = (len(pages) - 1) * self.page + self.last[b]
            k = k_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, 1)
            v = v_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, 1)
            rows = slice(self.qo[b], self.qo[b + 1])
            scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k) * self.scale
            m = scores.shape[1]
            if self.causal:
                at = torch.arange(n, device=scores.device)
                later = at[None, :] > at[n - m :, None]
                scores = scores.masked_fill(later, float("-inf"))
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,  # noqa: ANN001
             page_size, q_data_type=None, kv_data_type=None, sm_scale=None) -> None:  # fmt: skip
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, False, sm_scale)  # fmt: skip


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,  # noqa: ANN001
             head_dim, page_size, causal=False, q_data_type=None, kv_data_type=None,
             sm_scale=None) -> None:  # fmt: skip
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                   head_dim, page_size, causal, sm_scale)  # fmt: skip
