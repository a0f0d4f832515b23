"""The attention backends' per-layer options (Gemma 2 style): a sliding window, score
soft-capping and a custom scale, against a dense reference over mixed decode + prefill steps
with a cached prefix, at page sizes 1 and 16. ``torch_native`` and ``triton`` (interpreted on a
CPU machine) both must match; without options, the plain call is unchanged.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.core.batch import ForwardBatch  # noqa: E402
from radixserve.core.config import ModelConfig  # noqa: E402
from radixserve.core.memory import KVPool, ReqToTokenPool, TokenAllocator  # noqa: E402
from radixserve.plugins.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.plugins.attention.triton.backend import TritonAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, DIM = 6, 3, 16
CONFIG = ModelConfig.from_dict(
    {
        "architectures": ["Gemma2ForCausalLM"],
        "hidden_size": HEADS * DIM,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
)
#: window 5 is shorter than a CPU kernel block (16), 20 spans blocks; 0 is no window
OPTIONS = [
    {"sliding_window": 5},
    {"sliding_window": 20},
    {"logit_softcap": 2.0},
    {"sliding_window": 7, "logit_softcap": 2.0, "scale": 0.1},
    {},
]
IDS = ["window5", "window20", "softcap", "window-softcap-scale", "plain"]


def _step(pool: ReqToTokenPool, rows: list[int], kv_lens: list[int], new: list[int], nd: int,
          alloc: TokenAllocator) -> ForwardBatch:  # fmt: skip
    out_loc = []
    for row, start, n in zip(rows, kv_lens, new, strict=True):
        slots = alloc.alloc_extend(pool.table[row], start, n)
        assert slots is not None
        pool.write(row, start, slots)
        out_loc += slots.tolist()
    t = len(out_loc)
    return ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64, device=DEVICE),
        positions=torch.zeros(t, dtype=torch.int64, device=DEVICE),
        out_cache_loc=torch.tensor(out_loc, device=DEVICE),
        req_pool_indices=torch.tensor(rows),
        req_to_token=pool.table,
        seq_lens=[s + n for s, n in zip(kv_lens, new, strict=True)],
        extend_lens=list(new),
        num_decode=nd,
        logits_indices=torch.zeros(0, dtype=torch.int64, device=DEVICE),
        kv_pool=None,
        req_to_token_pool=pool,
    )


def _reference(q: torch.Tensor, kv: KVPool, batch: ForwardBatch, window: int, cap: float,
               scale: float) -> torch.Tensor:  # fmt: skip
    """Dense attention per request from the pool's K/V by position (float64)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    row0 = 0
    for i in range(batch.batch_size):
        total, new = batch.seq_lens[i], batch.extend_lens[i]
        slots = batch.req_to_token[batch.req_pool_indices[i], :total].to(DEVICE)
        k = kv.k[0][slots].double().repeat_interleave(HEADS // KV_HEADS, 1)  # [L, H, D]
        v = kv.v[0][slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
        qi = q[row0 : row0 + new].double()  # [n, H, D]
        s = torch.einsum("nhd,lhd->hnl", qi, k) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        q_pos = torch.arange(total - new, total, device=q.device)[:, None]
        k_pos = torch.arange(total, device=q.device)[None, :]
        keep = k_pos <= q_pos
        if window:
            keep &= k_pos > q_pos - window
        s = s.masked_fill(~keep, float("-inf"))
        out[row0 : row0 + new] = torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)
        row0 += new
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_options_match_dense_reference(page_size: int, options: dict) -> None:
    torch.manual_seed(0)
    size = 20 * page_size - 1 if page_size > 1 else 300
    pools = [KVPool(size, 1, KV_HEADS, DIM, torch.float32, DEVICE, page_size) for _ in range(2)]
    backends = [
        TritonAttention(pools[0], CONFIG, DEVICE),
        TorchNativeAttention(pools[1], CONFIG, DEVICE),
    ]
    alloc = TokenAllocator(size, page_size)
    pool = ReqToTokenPool(6, 96)
    # request 4 starts with a 21-token cached prefix, as after a radix-cache hit
    prefix = alloc.alloc(21)
    assert prefix is not None
    pool.write(4, 0, prefix)
    cached = pool.table[4, :21].to(DEVICE)
    for p in pools:
        p.k[0][cached] = torch.randn(
            21, KV_HEADS, DIM, generator=torch.Generator().manual_seed(1)
        ).to(DEVICE)
        p.v[0][cached] = torch.randn(
            21, KV_HEADS, DIM, generator=torch.Generator().manual_seed(2)
        ).to(DEVICE)
    steps = [  # (rows, cached, new, num_decode): prefills, then decodes mixed with chunks
        ([1, 3], [0, 0], [18, 5], 0),
        ([1, 3, 4, 0], [18, 5, 21, 0], [1, 1, 12, 40], 2),
        ([1, 3, 4, 0], [19, 6, 33, 40], [1, 1, 1, 1], 4),
        ([4, 0], [34, 41], [1, 23], 1),
    ]
    scale = options.get("scale", DIM**-0.5)
    for rows, kv_lens, new, nd in steps:
        batch = _step(pool, rows, kv_lens, new, nd, alloc)
        t = batch.num_tokens
        q = torch.randn(t, HEADS, DIM, device=DEVICE) * 2
        k = torch.randn(t, KV_HEADS, DIM, device=DEVICE)
        v = torch.randn(t, KV_HEADS, DIM, device=DEVICE)
        outs = []
        for backend in backends:
            backend.prepare(batch)
            outs.append(backend.forward(q, k, v, 0, batch, **options).view(t, HEADS, DIM))
        assert torch.equal(pools[0].k[0], pools[1].k[0])
        # the backends stored this step's K/V before attending: the reference reads them too
        window, cap = options.get("sliding_window", 0), options.get("logit_softcap", 0.0)
        ref = _reference(q, pools[1], batch, window, cap, scale)
        for out in outs:
            torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=0, atol=2e-5)
