"""The ``cpu_paged`` attention backend: torch_native's, with decodes in a C++ kernel.

torch_native attends a step's decodes by gathering every sequence's KV into a copy padded to the
longest one, then calling SDPA. At batch 32 with ~300-token contexts (SmolLM2 on 2 AVX2 cores)
that gather and SDPA took 3.3 + 3.7 ms a layer, two thirds of the decode step. The kernel
(``plugins/hardware/cpu_kernels/decode_attention.cpp``) reads each sequence's keys and values in
place through its slot row, with an online softmax, over torch's threads; a decode-only step
stores its K/V in the same call. Steps whose prefill chunks are small (speculative verify
steps, the short chunks run beside decodes) go through the same kernel, one row per new token
with its own causal length: torch_native's gather, mask and SDPA call cost ~0.5 ms a layer
more than the kernel on a 5-token verify (SmolLM2, 2 AVX2 cores: a verify step 66 ms against
a decode's 44). Larger prefill chunks stay torch_native's. Queries in float32 only, over a
float32 cache or a 16-bit one (--kv-cache-dtype); models in other dtypes run torch_native's
path.
"""

from __future__ import annotations

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.memory import KVPool
from radixserve.plugins.attention.torch_native import TorchNativeAttention
from radixserve.plugins.hardware import cpu_kernels

KERNEL_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: New tokens up to which a request's prefill chunk is attended by the kernel, one row per
#: token (each row re-reads the sequence's keys; SDPA's flash kernel wins on long chunks).
#: One SmolLM2 layer, 2 AVX2 cores, prepare + forward, kernel against torch_native: over 400
#: cached keys 5 new tokens 168 / 531 us, 16 457 / 611, 32 762 / 932, 64 1,387 / 1,351; over
#: 1,000: 16 900 / 1,053, 24 1,280 / 1,304, 32 1,658 / 1,539.
SMALL_EXTEND = 16


class CpuPagedAttention(TorchNativeAttention):
    def __init__(self, kv_pool: KVPool, model_config: ModelConfig, device: str) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"the cpu_paged attention backend runs on the CPU, not {device}; "
                "choose --plugin attention=torch_native or triton"
            )
        super().__init__(kv_pool, model_config, device)
        # the kernel's queries are float32; its KV float32, or 16-bit beside float32 weights
        fused = kv_pool.compute_dtype == torch.float32 and kv_pool.k[0].dtype in KERNEL_KV_DTYPES
        ops = cpu_kernels.load() if fused else None
        self._kernel = ops.decode_attention.default if ops is not None else None
        # a decode-only step's store and attention in one call (the store alone is four ops)
        self._store_kernel = ops.store_decode_attention.default if ops is not None else None
        # One kernel row per decode, or per new token of a step of small chunks (prepare)
        self._slots: torch.Tensor | None = None  # [rows, longest] each row's slots
        self._lens: torch.Tensor | None = None  # [rows] int64: keys each row attends
        self._starts: dict[int, torch.Tensor] = {}  # sliding window -> first key attended
        self._rows_per_token = False  # this step's every new token is one kernel row

    def set_batch_invariant(self) -> None:
        """Refused (torch_native's would be inherited, and bypassed by this backend's kernels,
        which take a step's rows as its shape allows)."""
        raise ConfigError(
            "--enable-deterministic-inference: the cpu_paged attention backend has no "
            "batch-invariant mode; use --plugin attention=torch_native (the CPU's default "
            "in this mode)"
        )

    def prepare(self, batch: ForwardBatch) -> None:
        nd = batch.num_decode
        small = all(n <= SMALL_EXTEND for n in batch.extend_lens[nd:])
        self._rows_per_token = self._store_kernel is not None and nd < batch.batch_size and small
        if not self._rows_per_token:
            super().prepare(batch)
            return
        # Token j of a chunk over a prefix of p keys attends p + j + 1 of its sequence's slots.
        rows: list[int] = []
        lens: list[int] = []
        pool_rows = batch.req_pool_indices.tolist()
        for i, (new, total) in enumerate(zip(batch.extend_lens, batch.seq_lens, strict=True)):
            rows += [pool_rows[i]] * new
            lens += range(total - new + 1, total + 1)
        table = batch.req_to_token[torch.tensor(rows), : max(batch.seq_lens)]
        self._prepare_decodes(table, lens)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
        batch: ForwardBatch, *, sliding_window: int = 0, logit_softcap: float = 0.0,
        scale: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if self._store_kernel is None or not (
            self._rows_per_token or batch.num_decode == batch.batch_size
        ):
            return super().forward(
                q, k, v, layer_id, batch, sliding_window=sliding_window,
                logit_softcap=logit_softcap, scale=scale,
            )  # fmt: skip
        assert self._slots is not None and self._lens is not None
        out = self._store_kernel(
            q.contiguous(), k, v, batch.out_cache_loc, self.kv_pool.k[layer_id],
            self.kv_pool.v[layer_id], self._slots, self._starts_for(sliding_window), self._lens,
            self.scale if scale is None else scale, logit_softcap,
        )  # fmt: skip
        return out.flatten(1)

    def _decodes_on_one_thread(self, keys: int) -> bool:
        # The kernel splits by request and KV head at little cost, and switching the pool's
        # size twice a layer slowed every other op of the step: SmolLM2 gguf at batch 1 on 2
        # AVX2 cores, 40.5 -> 32.1 ms a token, the 4-bit linears 21.6 -> 15.7 ms of it.
        return self._kernel is None and super()._decodes_on_one_thread(keys)

    def _prepare_decodes(self, table: torch.Tensor, lens: list[int]) -> None:
        if self._kernel is None:
            super()._prepare_decodes(table, lens)
            return
        self._slots = table.contiguous()
        self._lens = torch.tensor(lens, dtype=torch.int64)
        self._starts = {}

    def _decodes(
        self, q: torch.Tensor, layer_id: int, sliding_window: int, logit_softcap: float,
        scale: float,
    ) -> torch.Tensor:  # fmt: skip
        if self._kernel is None:
            return super()._decodes(q, layer_id, sliding_window, logit_softcap, scale)
        assert self._slots is not None and self._lens is not None
        k_buf, v_buf = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        starts = self._starts_for(sliding_window)
        return self._kernel(
            q.contiguous(), k_buf, v_buf, self._slots, starts, self._lens, scale, logit_softcap
        )

    def _starts_for(self, sliding_window: int) -> torch.Tensor:
        """Each decode's first key attended (past 0 under a sliding window), made once a step."""
        assert self._lens is not None
        starts = self._starts.get(sliding_window)
        if starts is None:
            starts = (self._lens - sliding_window).clamp_(min=0) if sliding_window else \
                torch.zeros_like(self._lens)  # fmt: skip
            self._starts[sliding_window] = starts
        return starts
