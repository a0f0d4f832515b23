"""cpu_paged's C++ decode kernel against a dense float64 reference and against torch_native:
GQA groups 1/3/4/8, odd and mixed lengths, scattered and consecutive slots, sliding windows and
soft-capping, decodes beside a prefill chunk, small chunks and verify steps one kernel row per
token, and one thread or the pool. End-to-end reuse traffic (retraction, cache hits, pages 1 and
16) is in test_reuse_traffic.py, where every available backend runs against torch_native."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kernel_checks import checked_without_the_kernels

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ModelConfig
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.plugins.attention.torch_native import TorchNativeAttention
from radixserve.plugins.hardware.cpu_kernels import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

DIM, POOL = 16, 1024


def _config(heads: int, kv_heads: int, dim: int = DIM) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": heads * dim,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": 1,
            "vocab_size": 10,
        }
    )


def _batch(
    slots: list[list[int]], prefill: list[int] | None = None,
    chunks: Sequence[tuple[list[int], int]] = (),
) -> ForwardBatch:  # fmt: skip
    """One decode per row of ``slots`` (its new token's slot last), then optionally one
    prefill chunk whose new tokens are the last ``prefill[1]`` of the slots ``prefill[0]``
    (or several: ``chunks``, (slots, new tokens) each)."""
    chunks = list(chunks) + ([(prefill[0], prefill[1])] if prefill is not None else [])
    table = ReqToTokenPool(len(slots) + len(chunks), POOL)
    for row, s in enumerate(slots):
        table.write(row, 0, torch.tensor(s))
    seq_lens, extend_lens, out = [len(s) for s in slots], [1] * len(slots), [s[-1] for s in slots]
    for row, (chunk_slots, new) in enumerate(chunks, start=len(slots)):
        table.write(row, 0, torch.tensor(chunk_slots))
        seq_lens.append(len(chunk_slots))
        extend_lens.append(new)
        out += chunk_slots[-new:]
    tokens = sum(extend_lens)
    return ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.zeros(tokens, dtype=torch.int64),
        out_cache_loc=torch.tensor(out),
        req_pool_indices=torch.arange(len(seq_lens)),
        req_to_token=table.table,
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        num_decode=len(slots),
        logits_indices=torch.zeros(0, dtype=torch.int64),
        kv_pool=None,
        req_to_token_pool=table,
    )


def _reference(q: torch.Tensor, pool: KVPool, slots: list[list[int]], group: int, window: int,
               cap: float) -> torch.Tensor:  # fmt: skip
    dim = q.shape[-1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, s in enumerate(slots):
        idx = torch.tensor(s[-window:] if window else s)
        k = pool.k[0][idx].double().repeat_interleave(group, 1)  # [L, H, D]
        v = pool.v[0][idx].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) * dim**-0.5
        if cap:
            scores = cap * torch.tanh(scores / cap)
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


def _pool(kv_heads: int, seed: int, dim: int = DIM, dtype: torch.dtype = torch.float32) -> KVPool:
    """A float32 model's pool: its cache in ``dtype`` (16-bit: --kv-cache-dtype)."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(POOL, 1, kv_heads, dim, dtype, "cpu", compute_dtype=torch.float32)
    pool.k[0].copy_(torch.randn(POOL + 1, kv_heads, dim, generator=gen))
    pool.v[0].copy_(torch.randn(POOL + 1, kv_heads, dim, generator=gen))
    return pool


def _scattered(lengths: list[int], seed: int) -> list[list[int]]:
    """Disjoint slot rows: up to 40 consecutive slots each (as a prefill gets them, from the
    pool's first half), the rest scattered over its second half (as decodes get them)."""
    assert len(lengths) <= 6 and sum(lengths) <= POOL // 2
    scattered = (torch.randperm(POOL // 2, generator=torch.Generator().manual_seed(seed)) + 1 +
                 POOL // 2).tolist()  # fmt: skip
    rows = []
    for i, n in enumerate(lengths):
        head = list(range(1 + 40 * i, 1 + 40 * i + min(n // 2, 40)))
        rows.append(head + [scattered.pop() for _ in range(n - len(head))])
    return rows


GQA = [(4, 4), (6, 2), (8, 2), (8, 1)]  # groups 1, 3, 4, 8
# Six decodes go round 1 or 2 threads a request at a time; one decode is split by KV head.
# Long ones with few KV heads are also split by keys into parts merged afterwards: up to 4 parts
# of 75 keys, and beside them short rows whose parts hold 0-10 keys.
DECODES = {"six": [1, 7, 64, 65, 100, 3], "one": [77], "long": [300], "long+short": [300, 1, 20]}


@pytest.mark.parametrize(("heads", "kv_heads"), GQA, ids=[f"group{h // k}" for h, k in GQA])
@pytest.mark.parametrize(("window", "cap"), [(0, 0.0), (5, 0.0), (0, 2.0)],
                         ids=["plain", "window5", "softcap2"])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim", [16, 64])  # 64: the kernel's compiled-in head dim
@pytest.mark.parametrize("decodes", list(DECODES))
def test_decodes_match_dense_reference_and_torch_native(
    heads: int, kv_heads: int, window: int, cap: float, threads: int, dim: int, decodes: str
) -> None:
    from radixserve.plugins.attention.cpu_paged.backend import CpuPagedAttention

    config, group = _config(heads, kv_heads, dim), heads // kv_heads
    slots = _scattered(DECODES[decodes], seed=heads + kv_heads)
    pool = _pool(kv_heads, seed=1, dim=dim)
    gen = torch.Generator().manual_seed(2)
    n = len(slots)
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(n, kv_heads, dim, generator=gen)
    v = torch.randn(n, kv_heads, dim, generator=gen)
    options = {"sliding_window": window, "logit_softcap": cap}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paged = CpuPagedAttention(pool, config, "cpu")
        batch = _batch(slots)
        paged.prepare(batch)
        ours = paged.forward(q, k, v, 0, batch, **options).view(n, heads, dim)
        native = TorchNativeAttention(pool, config, "cpu")
        native.prepare(batch)
        theirs = native.forward(q, k, v, 0, batch, **options).view(n, heads, dim)
    finally:
        torch.set_num_threads(before)
    ref = _reference(q, pool, slots, group, window, cap)  # the step's K/V are stored by now
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-6)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA, ids=[f"group{h // k}" for h, k in GQA])
@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("decodes", ["six", "long+short"])
def test_a_16_bit_cache_is_read_widened_like_torch_native(
    kv_dtype: torch.dtype, heads: int, kv_heads: int, dim: int, decodes: str
) -> None:
    """--kv-cache-dtype: float32 queries over a float16 / bfloat16 cache. The step's K/V are
    rounded as they are stored; the kernel then attends the cached values exactly (widened to
    float32), as torch_native does with its gathered copy."""
    from radixserve.plugins.attention.cpu_paged.backend import CpuPagedAttention

    config, group = _config(heads, kv_heads, dim), heads // kv_heads
    slots = _scattered(DECODES[decodes], seed=heads)
    pool = _pool(kv_heads, seed=3, dim=dim, dtype=kv_dtype)
    gen = torch.Generator().manual_seed(4)
    n = len(slots)
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(n, kv_heads, dim, generator=gen)
    v = torch.randn(n, kv_heads, dim, generator=gen)
    paged = CpuPagedAttention(pool, config, "cpu")
    assert paged._kernel is not None
    batch = _batch(slots)
    paged.prepare(batch)
    ours = paged.forward(q, k, v, 0, batch).view(n, heads, dim)
    stored = pool.k[0][torch.tensor([s[-1] for s in slots])]
    assert stored.dtype == kv_dtype and torch.equal(stored.float(), k.to(kv_dtype).float())
    native = TorchNativeAttention(pool, config, "cpu")
    native.prepare(batch)
    theirs = native.forward(q, k, v, 0, batch).view(n, heads, dim)
    assert ours.dtype == theirs.dtype == torch.float32
    ref = _reference(q, pool, slots, group, 0, 0.0)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-6)


@pytest.mark.parametrize(("new", "kernel"), [(12, True), (16, True), (17, False)])
def test_decodes_beside_a_prefill_chunk_match_torch_native(new: int, kernel: bool) -> None:
    """A mixed step: the decodes go through the kernel, and so does a chunk (with a cached
    prefix) of up to SMALL_EXTEND new tokens, one kernel row per token; a longer chunk goes
    through torch_native's path. The whole output equals torch_native's."""
    from radixserve.plugins.attention.cpu_paged.backend import CpuPagedAttention

    config = _config(6, 2)
    decodes = _scattered([9, 40, 2], seed=3)
    chunk = list(range(300, 337))  # 37 slots, the last `new` of them new
    batch = _batch(decodes, prefill=[chunk, new])
    tokens = len(decodes) + new
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(tokens, 6, DIM, generator=gen)
    k, v = torch.randn(tokens, 2, DIM, generator=gen), torch.randn(tokens, 2, DIM, generator=gen)
    outs = []
    for backend_cls in (CpuPagedAttention, TorchNativeAttention):
        pool = _pool(2, seed=5)
        backend = backend_cls(pool, config, "cpu")
        backend.prepare(batch)
        if backend_cls is CpuPagedAttention:
            assert backend._rows_per_token is kernel
        outs.append(backend.forward(q, k, v, 0, batch))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=2e-6)


@pytest.mark.parametrize(("heads", "kv_heads"), GQA, ids=[f"group{h // k}" for h, k in GQA])
@pytest.mark.parametrize(("window", "cap"), [(0, 0.0), (3, 0.0), (0, 2.0)],
                         ids=["plain", "window3", "softcap2"])  # fmt: skip
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_verify_chunks_go_through_the_kernel_and_match_torch_native(
    heads: int, kv_heads: int, window: int, cap: float, kv_dtype: torch.dtype
) -> None:
    """A speculative verify step: requests of 1-5 new tokens (the last token and its draft)
    over cached prefixes, one with no prefix at all, no decodes; each token attends its own
    causal length of its sequence, windowed and soft-capped as torch_native does."""
    from radixserve.plugins.attention.cpu_paged.backend import CpuPagedAttention

    config = _config(heads, kv_heads)
    rows = _scattered([30, 7, 5, 64], seed=8)
    chunks = [(rows[0], 5), (rows[1], 2), (rows[2], 5), (rows[3], 1)]  # rows[2]: no prefix
    batch = _batch([], chunks=chunks)
    tokens = sum(new for _, new in chunks)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(tokens, heads, DIM, generator=gen)
    k = torch.randn(tokens, kv_heads, DIM, generator=gen)
    v = torch.randn(tokens, kv_heads, DIM, generator=gen)
    outs = []
    for backend_cls in (CpuPagedAttention, TorchNativeAttention):
        pool = _pool(kv_heads, seed=10, dtype=kv_dtype)
        backend = backend_cls(pool, config, "cpu")
        backend.prepare(batch)
        if backend_cls is CpuPagedAttention:
            assert backend._rows_per_token
        outs.append(backend.forward(q, k, v, 0, batch, sliding_window=window, logit_softcap=cap))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=5e-6)


def test_other_dtypes_take_torch_natives_path() -> None:
    """bfloat16 KV is not the kernel's: the backend attends it as torch_native does."""
    from radixserve.plugins.attention.cpu_paged.backend import CpuPagedAttention

    config = _config(6, 2)
    pool = KVPool(POOL, 1, 2, DIM, torch.bfloat16, "cpu")
    pool.k[0].normal_()
    pool.v[0].normal_()
    slots = _scattered([5, 11], seed=6)
    batch = _batch(slots)
    q = torch.randn(2, 6, DIM, dtype=torch.bfloat16)
    kv = torch.randn(2, 2, DIM, dtype=torch.bfloat16)
    paged = CpuPagedAttention(pool, config, "cpu")
    native = TorchNativeAttention(pool, config, "cpu")
    assert paged._kernel is None
    paged.prepare(batch)
    native.prepare(batch)
    ours, theirs = paged.forward(q, kv, kv, 0, batch), native.forward(q, kv, kv, 0, batch)
    torch.testing.assert_close(ours, theirs)


def test_kernel_rejects_bad_inputs_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = checked_without_the_kernels(monkeypatch)
    kernel = ops.decode_attention
    pool = _pool(2, seed=7)
    q = torch.randn(1, 6, DIM)
    slots, starts = torch.tensor([[1, 2, 3]]), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="starts <= lens <= slots.size"):
        kernel(q, pool.k[0], pool.v[0], slots, starts, torch.tensor([4]), 0.25, 0.0)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(q.double(), pool.k[0], pool.v[0], slots, starts, torch.tensor([3]), 0.25, 0.0)
    # a slot past the pool: the kernel itself reads it unchecked (an out-of-bounds read)
    with pytest.raises(RuntimeError, match=f"slot {POOL + 1} outside the pool of {POOL + 1}"):
        kernel(q, pool.k[0], pool.v[0], torch.tensor([[1, POOL + 1, 3]]), starts,
               torch.tensor([3]), 0.25, 0.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="q is on meta; the kernel runs on the CPU"):
        kernel(q.to("meta"), pool.k[0], pool.v[0], slots, starts, torch.tensor([3]), 0.25, 0.0)
    store = ops.store_decode_attention
    kv = torch.randn(1, 2, DIM)
    lens = torch.tensor([3])
    with pytest.raises(RuntimeError, match=f"slot {POOL + 1} outside the pool of {POOL + 1}"):
        store(q, kv, kv, torch.tensor([POOL + 1]), pool.k[0], pool.v[0], slots, starts, lens,
              0.25, 0.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="loc must be int64"):
        store(q, kv, kv, torch.tensor([3, 4]), pool.k[0], pool.v[0], slots, starts, lens,
              0.25, 0.0)  # fmt: skip


def test_the_checked_kernel_computes_what_the_kernel_does() -> None:
    from radixserve.plugins.hardware.cpu_kernels import checked, load

    pool = _pool(2, seed=9)
    q = torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(10))
    slots = torch.tensor([[5, 9, 2, 0], [7, 1, 3, 8]])
    starts, lens = torch.tensor([0, 1]), torch.tensor([3, 4])
    args = (q, pool.k[0], pool.v[0], slots, starts, lens, 0.25, 0.0)
    assert torch.equal(checked().decode_attention(*args), load().decode_attention(*args))


def test_refuses_a_non_cpu_device() -> None:
    from radixserve.plugins.attention.cpu_paged.backend import CpuPagedAttention

    with pytest.raises(ValueError, match="runs on the CPU"):
        CpuPagedAttention(_pool(2, seed=8), _config(6, 2), "cuda")


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_native"])
def test_a_small_decode_step_keeps_the_pools_threads_only_with_the_kernel(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_native runs a small decode attention on one thread (its SDPA's split cost more
    than it saved); the kernel splits cheaply, so cpu_paged leaves the pool's size alone:
    switching it twice a layer slowed the step's other ops (issue 19, batch 1)."""
    from radixserve.plugins.attention.cpu_paged.backend import CpuPagedAttention

    cls = CpuPagedAttention if backend == "cpu_paged" else TorchNativeAttention
    config, pool = _config(4, 2), _pool(2, seed=3)
    slots = _scattered([40], seed=4)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, DIM, generator=gen) for h in (4, 2, 2))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    sizes: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (sizes.append(n), real(n))[1])
    try:
        attn = cls(pool, config, "cpu")
        batch = _batch(slots)
        attn.prepare(batch)
        attn.forward(q, k, v, 0, batch)
    finally:
        real(before)
    assert sizes == ([] if backend == "cpu_paged" else [1, 2])
