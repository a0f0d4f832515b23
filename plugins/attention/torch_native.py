"""torch_native attention: the reference backend for CPU and GPU.

Decodes are attended in one batched SDPA call over KV gathered to the longest sequence (masked
only when lengths differ); a lone decode whose slots are consecutive reads the pool in place;
prefill chunks run one SDPA call per request with a causal mask offset by the cached prefix.
Index tensors are built once per step in ``prepare`` and reused by every layer. KV is gathered
with ``index_select`` (about 3x faster than advanced indexing on CPU) and query heads are grouped
by their KV head, so GQA never repeats K/V in memory.

On CPU a small decode attention (at most SERIAL_DECODE_TOKENS keys over the batch: its KV store,
gather and SDPA) runs on one thread. Split over the intra-op pool, each of those ops paid ~110 us
of waking the other thread between the layer's other ops (SmolLM2 at batch 1 on a 2-core AVX2
VM, in the engine: SDPA 153-181 us a call on 2 threads, 62-65 on one, ~50 in a loop of its own;
a 200-row gather 182 us against 12).

Per-layer options (keywords of ``forward``, all off by default): ``sliding_window`` W (a token at
position p sees keys at positions p - W + 1 .. p, transformers' convention), ``logit_softcap`` c
(scores become c * tanh(s / c) before the softmax, as Gemma 2) and ``scale`` (instead of
head_dim ** -0.5). Window masks are built once per step and window size; soft-capping runs the
attention as explicit matmuls (SDPA has no hook for it).
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
from radixserve.plugins.attention import fixed_split

#: Keys (decodes x longest sequence) up to which a CPU decode attention runs on one thread.
#: Measured on 2 AVX2 cores with SmolLM2's 3 KV heads of 64: at 1,000 keys one thread took
#: 205 us against 160 us on two plus the ~110 us wake-up; at 4,000, 792 against 593 + 110.
SERIAL_DECODE_TOKENS = 2048


@dataclass(slots=True)
class _Extend:
    start: int  # first row of this request in the flattened new tokens
    end: int
    kv_slots: torch.Tensor  # [seq_len]
    mask: torch.Tensor | None  # [new, seq_len] bool, None when there is no cached prefix
    prefix: int
    windowed: dict[int, torch.Tensor]  # window -> [new, seq_len] bool mask, built on first use


class TorchNativeAttention(AttentionBackend):
    reads_other_kv_dtype = True  # gathered K/V are widened to the queries' dtype

    def __init__(self, kv_pool: KVPool, model_config: ModelConfig, device: str) -> None:
        self.kv_pool = kv_pool
        self._fp8_kv = getattr(kv_pool, "saturate", False)  # reads multiply by its scales
        self.scale = model_config.head_dim**-0.5
        self.device = device
        self.num_kv_heads = model_config.num_kv_heads
        self.group = model_config.num_heads // model_config.num_kv_heads
        self._decode_slots: torch.Tensor | None = None
        # CPU only: reading a lone decode's KV in place (a CUDA graph captured over a slice
        # would replay the same slice), and small decode attentions on one thread.
        self._on_cpu = torch.device(device).type == "cpu"
        self._decode_run: slice | None = None  # a lone decode's slots, when consecutive
        self._decode_mask: torch.Tensor | None = None
        self._decode_lens: torch.Tensor | None = None
        self._decode_windowed: dict[int, torch.Tensor] = {}
        self._extends: list[_Extend] = []
        self._one_thread = _OneThread()  # small decode attentions run on one thread
        #: --enable-deterministic-inference: the step's rows for fixed_split.attend
        self._invariant = False
        self._rows: fixed_split.RowTable | None = None

    def set_batch_invariant(self) -> None:
        """Every row (decode, extend, verify) through ``fixed_split.attend``: a fixed KV
        split, so a row's result does not depend on its step (core/deterministic.py)."""
        self._invariant = True

    def prepare(self, batch: ForwardBatch) -> None:
        if self._invariant:
            rows = batch.req_pool_indices.tolist()
            self._rows = fixed_split.row_table(
                list(zip(rows, batch.extend_lens, batch.seq_lens, strict=True)),
                batch.req_to_token, self.device,
            )  # fmt: skip
            return
        nd = batch.num_decode
        rows = batch.req_pool_indices
        self._decode_slots = self._decode_mask = self._decode_lens = self._decode_run = None
        self._decode_windowed = {}
        self._one_thread.threads = 0
        if nd:
            lens = batch.seq_lens[:nd]
            max_len = max(lens)
            self._prepare_decodes(batch.req_to_token[rows[:nd], :max_len], lens)
            threads = torch.get_num_threads() if self._on_cpu else 1
            serial = threads > 1 and self._decodes_on_one_thread(nd * max_len)
            self._one_thread.threads = threads if serial else 0
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
            self._extends.append(_Extend(start, start + new, slots, mask, prefix, {}))
            start += new

    def _decodes_on_one_thread(self, keys: int) -> bool:
        """Whether a CPU step's decode attention over ``keys`` keys (decodes x longest) runs
        on one thread: SDPA's split over the pool costs more than it saves on small ones."""
        return keys <= SERIAL_DECODE_TOKENS

    def _prepare_decodes(self, table: torch.Tensor, lens: list[int]) -> None:
        """The step's decode tensors from their slot rows ``table`` [nd, longest] (host)."""
        nd, max_len = table.shape
        self._decode_run = _slot_run(table) if nd == 1 and self._on_cpu else None
        if self._decode_run is None:
            self._decode_slots = table.flatten().to(self.device)
        lens_t = torch.tensor(lens, device=self.device)
        if min(lens) < max_len:  # rows padded to the longest: mask the padding
            mask = torch.arange(max_len, device=self.device)[None, :] < lens_t[:, None]
            self._decode_mask = mask[:, None, None, :]
        self._decode_lens = lens_t

    def _decode_mask_for(self, window: int) -> torch.Tensor:
        """[nd, 1, 1, max_len]: keys inside each decode's sequence and its last ``window``."""
        mask = self._decode_windowed.get(window)
        if mask is None:
            assert self._decode_lens is not None
            lens = self._decode_lens
            pos = torch.arange(int(lens.max()), device=self.device)
            inside = (pos[None, :] >= (lens - window)[:, None]) & (pos[None, :] < lens[:, None])
            mask = inside[:, None, None, :]
            self._decode_windowed[window] = mask
        return mask

    @staticmethod
    def _extend_mask_for(ext: _Extend, window: int) -> torch.Tensor:
        """[new, seq_len]: causal, and within ``window`` of the query (window 0: no limit)."""
        mask = ext.windowed.get(window)
        if mask is None:
            total = ext.kv_slots.shape[0]
            device = ext.kv_slots.device
            q_pos = torch.arange(ext.prefix, total, device=device)[:, None]
            k_pos = torch.arange(total, device=device)[None, :]
            mask = k_pos <= q_pos
            if window:
                mask = mask & (k_pos > q_pos - window)
            ext.windowed[window] = mask
        return mask

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
    ) -> torch.Tensor:
        scale = self.scale if scale is None else scale
        if self._rows is not None:
            self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
            k_buf, v_buf = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
            return fixed_split.attend(
                q, k_buf, v_buf, self._rows, scale, window=sliding_window, softcap=logit_softcap
            ).flatten(1)
        nd = batch.num_decode
        if nd == batch.batch_size:  # decodes only: the KV store too is a small op
            with self._one_thread:
                self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
                return self._decodes(q, layer_id, sliding_window, logit_softcap, scale).flatten(1)
        self.kv_pool.store(layer_id, batch.out_cache_loc, k, v)
        out = torch.empty_like(q)
        if nd:
            with self._one_thread:
                out[:nd] = self._decodes(q[:nd], layer_id, sliding_window, logit_softcap, scale)
        k_buf, v_buf = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        for ext in self._extends:
            qe = q[ext.start : ext.end].transpose(0, 1)  # [H, n, d]
            # [kvh, L, d], widened to the queries' dtype where the cache is kept narrower
            ke = _gather(k_buf, ext.kv_slots).transpose(0, 1).to(qe.dtype)
            ve = _gather(v_buf, ext.kv_slots).transpose(0, 1).to(qe.dtype)
            if self._fp8_kv:  # an FP8 cache: its values times the layer's scales
                ke, ve = self._scaled(layer_id, ke, ve)
            if logit_softcap:
                kvh, n, d = ke.shape[0], qe.shape[1], qe.shape[2]
                oe = _softcapped_attention(
                    qe.reshape(kvh, self.group, n, d), ke[:, None], ve[:, None],
                    self._extend_mask_for(ext, sliding_window), scale, logit_softcap,
                ).reshape(-1, n, d)  # fmt: skip
            else:
                mask = ext.mask
                if sliding_window:
                    mask = self._extend_mask_for(ext, sliding_window)
                # 4-D inputs: on CPU, 3-D ones fall back to SDPA's math path (masked softmax
                # materialised), 3.3x slower on SmolLM2's 256-token prefills than the flash
                # kernel 4-D ones get.
                oe = F.scaled_dot_product_attention(
                    qe[None],
                    ke[None],
                    ve[None],
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=scale,
                    enable_gqa=True,
                )[0]
            out[ext.start : ext.end] = oe.transpose(0, 1)
        return out.flatten(1)

    def _scaled(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 cache's widened K and V times the layer's scales (--kv-cache-dtype
        fp8_e4m3); the reference the Triton kernels are tested against."""
        ks, vs = self.kv_pool.k_scales[layer_id], self.kv_pool.v_scales[layer_id]
        return (k if ks == 1.0 else k * ks), (v if vs == 1.0 else v * vs)

    def _decodes(
        self, q: torch.Tensor, layer_id: int, sliding_window: int, logit_softcap: float,
        scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """[nd, H, d]: the attention of the step's decodes (their KV already stored)."""
        nd, d = q.shape[0], q.shape[-1]
        kvh = self.num_kv_heads
        k_buf, v_buf = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        run = self._decode_run
        if run is not None:  # read the pool in place
            kd, vd = k_buf[run][None].transpose(1, 2), v_buf[run][None].transpose(1, 2)
        else:
            assert self._decode_slots is not None
            kd = _gather(k_buf, self._decode_slots).view(nd, -1, kvh, d).transpose(1, 2)
            vd = _gather(v_buf, self._decode_slots).view(nd, -1, kvh, d).transpose(1, 2)
        kd, vd = kd.to(q.dtype), vd.to(q.dtype)  # a cache kept narrower than the queries
        if self._fp8_kv:
            kd, vd = self._scaled(layer_id, kd, vd)
        # [B, H, d] -> [B, kvh, group, d]: HF's GQA maps query head h to KV head h // group
        qd = q.view(nd, kvh, self.group, d)
        mask = self._decode_mask_for(sliding_window) if sliding_window else self._decode_mask
        if logit_softcap:
            od = _softcapped_attention(qd, kd, vd, mask, scale, logit_softcap)
        else:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        return od.reshape(nd, -1, d)


class _OneThread:
    """Inside: torch's intra-op pool set to one thread, restored after (``threads`` 0: left
    alone)."""

    __slots__ = ("threads",)

    def __init__(self) -> None:
        self.threads = 0

    def __enter__(self) -> None:
        if self.threads:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots] for a [slots, heads, d] buffer: rows of a 2-D view, which index_select
    copies several times faster than the 3-D buffer's (measured on CPU). An FP8 buffer's
    rows go as bytes (torch's CPU index_select takes no FP8)."""
    if buf.dtype.itemsize == 1 and buf.is_floating_point():
        rows = buf.view(torch.uint8).view(buf.shape[0], -1).index_select(0, slots)
        return rows.view(buf.dtype).view(-1, *buf.shape[1:])
    return buf.view(buf.shape[0], -1).index_select(0, slots).view(-1, *buf.shape[1:])


def _slot_run(table: torch.Tensor) -> slice | None:
    """The pool rows of the single row of ``table`` (host) when its slots are consecutive
    (its KV is then a slice of the pool), else None."""
    row = table[0]
    first, n = int(row[0]), row.numel()
    if int(row[-1]) - first != n - 1 or not bool((row[1:] - row[:-1] == 1).all()):
        return None
    return slice(first, first + n)


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    scale: float, cap: float,
) -> torch.Tensor:  # fmt: skip
    """softmax(cap * tanh(q k^T * scale / cap), masked) v; q [..., n, d], k and v [..., L, d]
    broadcastable, mask broadcastable to [..., n, L] (True: attend)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


@hookimpl
def register_attention_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "torch_native",
        TorchNativeAttention,
        description="reference paged attention with torch SDPA (CPU and GPU)",
    )
