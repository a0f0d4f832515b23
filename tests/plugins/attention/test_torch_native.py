"""torch_native's decode paths against a dense float64 reference: a lone decode whose slots are
consecutive reads the pool in place (no gather), scattered slots are gathered, a batch of equal
lengths runs unmasked and one of mixed lengths masks its padding; a sliding window applies on
each path."""

from __future__ import annotations

import pytest
import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ModelConfig
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.plugins.attention.torch_native import TorchNativeAttention

HEADS, KV_HEADS, DIM = 6, 2, 8
CONFIG = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HEADS * DIM,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
)
POOL = 64


def _decode_batch(table: ReqToTokenPool, slots: list[list[int]]) -> ForwardBatch:
    """One decode per row of ``slots`` (the row's KV slots, its new token's last)."""
    for row, s in enumerate(slots):
        table.write(row, 0, torch.tensor(s))
    return ForwardBatch(
        input_ids=torch.zeros(len(slots), dtype=torch.int64),
        positions=torch.tensor([len(s) - 1 for s in slots]),
        out_cache_loc=torch.tensor([s[-1] for s in slots]),
        req_pool_indices=torch.arange(len(slots)),
        req_to_token=table.table,
        seq_lens=[len(s) for s in slots],
        extend_lens=[1] * len(slots),
        num_decode=len(slots),
        logits_indices=torch.zeros(0, dtype=torch.int64),
        kv_pool=None,
        req_to_token_pool=table,
    )


def _reference(q: torch.Tensor, pool: KVPool, slots: list[list[int]], window: int) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, s in enumerate(slots):
        idx = torch.tensor(s[-window:] if window else s)
        k = pool.k[0][idx].double().repeat_interleave(HEADS // KV_HEADS, 1)  # [L, H, D]
        v = pool.v[0][idx].double().repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) * DIM**-0.5
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


CASES = {
    "one-consecutive": ([list(range(5, 22))], True),
    "one-scattered": ([[9, 3, 40, 41, 42, 7, 30]], False),
    "equal-lengths": ([list(range(1, 11)), list(range(20, 30))], False),
    "mixed-lengths": ([list(range(1, 4)), [50, 12, 33, 34, 35, 2, 60, 61]], False),
}


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_paths_match_dense_reference(case: str, window: int) -> None:
    slots, in_place = CASES[case]
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(POOL, 1, KV_HEADS, DIM, torch.float32, "cpu")
    pool.k[0].copy_(torch.randn(POOL + 1, KV_HEADS, DIM, generator=gen))
    pool.v[0].copy_(torch.randn(POOL + 1, KV_HEADS, DIM, generator=gen))
    backend = TorchNativeAttention(pool, CONFIG, "cpu")
    batch = _decode_batch(ReqToTokenPool(4, 32), slots)
    backend.prepare(batch)
    assert (backend._decode_run is not None) == in_place
    assert (backend._decode_mask is not None) == (case == "mixed-lengths")
    n = len(slots)
    q = torch.randn(n, HEADS, DIM, generator=gen)
    k = torch.randn(n, KV_HEADS, DIM, generator=gen)
    v = torch.randn(n, KV_HEADS, DIM, generator=gen)
    options = {"sliding_window": window} if window else {}
    out = backend.forward(q, k, v, 0, batch, **options).view(n, HEADS, DIM)
    ref = _reference(q, pool, slots, window)  # the step's own K/V are in the pool by now
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("case", ["one-consecutive", "mixed-lengths"])
def test_small_decode_attention_runs_on_one_thread(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to SERIAL_DECODE_TOKENS keys a decode attention runs on one thread (waking the
    intra-op pool cost more than it saved), past them on all, and the count is restored."""
    from radixserve.plugins.attention import torch_native

    slots = CASES[case][0]
    sdpa, seen = torch_native.F.scaled_dot_product_attention, []

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch_native.F, "scaled_dot_product_attention", counting)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool = KVPool(POOL, 1, KV_HEADS, DIM, torch.float32, "cpu")
        backend = TorchNativeAttention(pool, CONFIG, "cpu")
        n = len(slots)
        q, kv = torch.randn(n, HEADS, DIM), torch.randn(n, KV_HEADS, DIM)
        for limit, expected in ((torch_native.SERIAL_DECODE_TOKENS, 1), (4, 2)):
            monkeypatch.setattr(torch_native, "SERIAL_DECODE_TOKENS", limit)
            batch = _decode_batch(ReqToTokenPool(4, 32), slots)
            backend.prepare(batch)
            seen.clear()
            backend.forward(q, kv, kv, 0, batch)
            assert seen == [expected] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
