"""The Triton kernels (extend, split-K decode, KV store) against a plain torch reference.

On a CPU machine (CI) they run under TRITON_INTERPRET=1 at small sizes; on a CUDA machine the
same tests run compiled, at real sizes (Llama-3.1-8B heads, contexts up to 4k tokens). Each
runs with page size 1 (every position anywhere in the pool) and 16 (whole pages scattered over
the pool), so lengths and cached prefixes cross page boundaries at odd places.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: must be set before the kernels are defined (triton.jit reads it at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.plugins.attention.triton.decode_kernel import (  # noqa: E402
    MERGE_IN_LAUNCH_SPLITS,
    decode_attention,
    new_counters,
    num_decode_splits,
)
from radixserve.plugins.attention.triton.extend_kernel import extend_attention  # noqa: E402
from radixserve.plugins.attention.triton.store_kernel import (  # noqa: E402
    store_kv,
    store_kv_rotary,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
HEAD_DIM = 128 if GPU else 32
KV_HEADS = 8 if GPU else 2
# Odd lengths and lengths around the kernels' block size (16 on the CPU, 64 on the GPU).
DECODE_LENS = (
    [1, 63, 64, 65, 127, 640, 1023, 1500, 4096, 2049] * 3 if GPU else [1, 15, 16, 17, 33, 50]
)
EXTEND_CASES = (  # (cached prefix, new tokens)
    [(0, 1), (0, 1024), (100, 1), (63, 65), (2000, 517), (4000, 96), (1, 3000), (777, 64)]
    if GPU
    else [(0, 1), (0, 17), (5, 1), (15, 16), (16, 33), (31, 3)]
)
DTYPES = [torch.bfloat16] if GPU else [torch.float32, torch.bfloat16]
PAGE_SIZES = [1, 16]
# Query heads per KV head: 1 (MHA), 3 (not a power of two: SmolLM2's), 4 (Llama-3.1-8B's), 8.
# Under the interpreter 8 is left out: it takes the same path as 4 in both kernels (decode pads
# the group to BLOCK_G = max(16, next_power_of_2(group)) rows and masks the rest; extend runs a
# program per query head and maps it to its KV head by h // GROUP), and it was the costliest
# case (37 of the file's 113 s on one CPU core).
GROUPS = [1, 3, 4, 8] if GPU else [1, 3, 4]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-5


def _paged_setup(lens: list[int], num_kv_heads: int, dtype: torch.dtype, seed: int,
                 page_size: int = 1):  # fmt: skip  # noqa: ANN202
    """A pool with random K/V and a table that scatters each sequence's pages over random pages
    of the pool (page 0 is padding); within a page, positions map to consecutive slots."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_seq) + 7  # spare pages: the mapping is not a permutation
    size = (num_pages + 1) * page_size
    k_buf = torch.randn(size, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v_buf = torch.randn(size, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen) + 1
    rows = len(lens) + 3
    table = torch.zeros(rows, max(lens) + 5, dtype=torch.int32)
    req_rows = torch.randperm(rows, generator=gen)[: len(lens)].to(torch.int32)
    offset = 0
    for row, n, k in zip(req_rows.tolist(), lens, pages_per_seq, strict=True):
        pages = perm[offset : offset + k]
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        table[row, :n] = slots.to(torch.int32)
        offset += k
    return k_buf, v_buf, table, req_rows


def _reference(q, k_buf, v_buf, table, row: int, seq_len: int, q_pos: torch.Tensor):  # noqa: ANN001, ANN202
    """Attention of queries at positions ``q_pos`` over a sequence's first seq_len KV, float64
    (on the test device: at real sizes the CPU would take minutes)."""
    q, k_buf, v_buf, table, q_pos = _dev(q, k_buf, v_buf, table, q_pos)
    slots = table[row, :seq_len].long()
    k = k_buf[slots].double()  # [L, KVH, D]
    v = v_buf[slots].double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * HEAD_DIM**-0.5  # [H, n, L]
    mask = torch.arange(seq_len, device=DEVICE)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).cpu()  # [n, H, D]


def _dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
def test_decode_matches_reference(group: int, dtype: torch.dtype, page_size: int) -> None:
    lens = DECODE_LENS
    k_buf, v_buf, table, req_rows = _paged_setup(lens, KV_HEADS, dtype, group, page_size)
    bs, heads = len(lens), KV_HEADS * group
    q = torch.randn(bs, heads, HEAD_DIM, generator=torch.Generator().manual_seed(7)).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    refs = [
        _reference(q[b : b + 1], k_buf, v_buf, table, int(req_rows[b]), n, torch.tensor([n - 1]))
        for b, n in enumerate(lens)
    ]
    # One split (no merge); the default count merged by a second kernel; the most merged by
    # the last split of each group (counters) in the same launch.
    default = num_decode_splits(bs, KV_HEADS, 132 if GPU else 4)
    for splits, merge_last in [(1, False), (default, False), (MERGE_IN_LAUNCH_SPLITS, True)]:
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        part_out = torch.empty(bs, heads, splits, HEAD_DIM)
        part_lse = torch.empty(bs, heads, splits)
        dq, dk, dv, dt, drows, dlens, dout, dpo, dpl = _dev(
            q, k_buf, v_buf, table, req_rows, seq_lens, out, part_out, part_lse
        )
        counters = new_counters(bs, KV_HEADS, dq.device) if merge_last else None
        for _ in range(2 if merge_last else 1):  # a second launch finds the counters reset
            dout.fill_(float("nan"))
            decode_attention(dq, dk, dv, dt, drows, dlens, dout, dpo, dpl, HEAD_DIM**-0.5,
                             page_size=page_size, counters=counters)  # fmt: skip
            out = dout.cpu()
            assert not out.isnan().any()
            for b, n in enumerate(lens):
                err = _rel_err(out[b : b + 1], refs[b])
                assert err < _tolerance(dtype), f"splits={splits} len={n}: rel err {err:.2e}"
        if counters is not None:
            assert not counters.any(), "the merge must leave the counters at zero"


@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", GROUPS)
def test_extend_matches_reference(
    group: int, dtype: torch.dtype, page_size: int, pack_gqa: bool
) -> None:
    """Per query head (the default) and with a KV head's query heads packed into one program's
    rows (``pack_gqa``, deterministic mode's launch: a token's group spans blocks at group 3)."""
    if pack_gqa and group == 1:
        pytest.skip("one query head a KV head: nothing to pack")
    cases = EXTEND_CASES
    seq = [p + n for p, n in cases]
    k_buf, v_buf, table, req_rows = _paged_setup(seq, KV_HEADS, dtype, 10 + group, page_size)
    heads = KV_HEADS * group
    ext = [n for _, n in cases]
    starts = [sum(ext[:i]) for i in range(len(ext))]
    q = torch.randn(sum(ext), heads, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    q = q.to(dtype)
    out = torch.full_like(q, float("nan"))
    meta = [torch.tensor(x, dtype=torch.int32) for x in (seq, ext, starts)]
    dq, dk, dv, dout, dt, drows, dseq, dext, dstarts = _dev(
        q, k_buf, v_buf, out, table, req_rows, *meta
    )
    extend_attention(dq, dk, dv, dout, dt, drows, dseq, dext, dstarts, max(ext), HEAD_DIM**-0.5,
                     page_size=page_size, pack_gqa=pack_gqa)  # fmt: skip
    out = dout.cpu()
    assert not out.isnan().any()
    for r, (prefix, n) in enumerate(cases):
        rows = slice(starts[r], starts[r] + n)
        ref = _reference(q[rows], k_buf, v_buf, table, int(req_rows[r]), prefix + n,
                         torch.arange(prefix, prefix + n))  # fmt: skip
        err = _rel_err(out[rows], ref)
        assert err < _tolerance(dtype), f"prefix={prefix} new={n}: rel err {err:.2e}"


def _strided(index: torch.Tensor) -> torch.Tensor:
    """``index``'s values as a view with stride 2 (a column of a staged buffer: the EAGLE
    proposal graph passes its catch-up slots so at batch 1, and the stores once read them as
    contiguous, writing all but the first row's K/V to other slots)."""
    return torch.stack([index, torch.zeros_like(index)], dim=1)[:, 0]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-slots"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_the_slots(dtype: torch.dtype, strided: bool) -> None:
    tokens, size = (300, 1000) if GPU else (9, 40)
    qkv = torch.randn(tokens, 3 * KV_HEADS * HEAD_DIM).to(dtype)  # k, v as strided views
    k = qkv[:, KV_HEADS * HEAD_DIM : 2 * KV_HEADS * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, 2 * KV_HEADS * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(size)[:tokens] + 1
    k_buf = torch.randn(size + 1, KV_HEADS, HEAD_DIM).to(dtype)
    v_buf = torch.randn(size + 1, KV_HEADS, HEAD_DIM).to(dtype)
    want_k, want_v = k_buf.clone(), v_buf.clone()
    want_k[slots], want_v[slots] = k, v
    dk, dv, dkb, dvb, ds = _dev(k, v, k_buf, v_buf, slots)
    store_kv(dk, dv, dkb, dvb, _strided(ds) if strided else ds)
    assert torch.equal(dkb.cpu(), want_k) and torch.equal(dvb.cpu(), want_v)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-indices"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_rotary_equals_rope_then_store(dtype: torch.dtype, strided: bool) -> None:
    """The store that applies RoPE on the way writes what the model's RoPE followed by the
    plain store writes, bit for bit, and returns the rotated q."""
    from radixserve.core.config import ModelConfig
    from radixserve.plugins.models.blocks import RotaryEmbedding

    heads = 3 * KV_HEADS
    tokens, size = (300, 1000) if GPU else (9, 40)
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": heads * HEAD_DIM,
        "num_attention_heads": heads, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1, "vocab_size": 10, "max_position_embeddings": 4096,
    })  # fmt: skip
    from radixserve.plugins.models import fused_ops

    rope = RotaryEmbedding(config, DEVICE, dtype)
    rope.fused = fused_ops  # the model's Triton RoPE (interpreted on a CPU), as on a GPU
    qkv = torch.randn(tokens, (heads + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    qk = qkv[:, : (heads + KV_HEADS) * HEAD_DIM].view(tokens, heads + KV_HEADS, HEAD_DIM)
    v = qkv[:, (heads + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 4000, (tokens,))
    slots = torch.randperm(size)[:tokens] + 1
    k_buf = torch.randn(size + 1, KV_HEADS, HEAD_DIM).to(dtype)
    v_buf = torch.randn(size + 1, KV_HEADS, HEAD_DIM).to(dtype)
    dqk, dv, dpos, ds = _dev(qk, v, positions, slots)
    want_kb, want_vb = _dev(k_buf, v_buf)
    rotated = rope.apply(dqk, dpos)
    store_kv(rotated[:, heads:], dv, want_kb, want_vb, ds)
    got_kb, got_vb = _dev(k_buf, v_buf)
    if strided:
        ds, dpos = _strided(ds), _strided(dpos)
    q = store_kv_rotary(dqk[:, :heads], dqk[:, heads:], dv, got_kb, got_vb, ds, dpos,
                        rope.cos, rope.sin)  # fmt: skip
    torch.testing.assert_close(q, rotated[:, :heads], rtol=0, atol=0)
    torch.testing.assert_close(got_kb, want_kb, rtol=0, atol=0)
    assert torch.equal(got_vb, want_vb)


def _decode_err(lens: list[int], group: int, setup_page: int, kernel_page: int) -> float:
    """Largest relative error of the decode kernel run with ``kernel_page`` over a table laid
    out with ``setup_page`` (float32)."""
    k_buf, v_buf, table, req_rows = _paged_setup(lens, KV_HEADS, torch.float32, 5, setup_page)
    bs, heads = len(lens), KV_HEADS * group
    q = torch.randn(bs, heads, HEAD_DIM, generator=torch.Generator().manual_seed(9))
    splits = 2
    out = torch.full_like(q, float("nan"))
    dq, dk, dv, dt, drows, dlens, dout, dpo, dpl = _dev(
        q, k_buf, v_buf, table, req_rows, torch.tensor(lens, dtype=torch.int32), out,
        torch.empty(bs, heads, splits, HEAD_DIM), torch.empty(bs, heads, splits),
    )  # fmt: skip
    decode_attention(dq, dk, dv, dt, drows, dlens, dout, dpo, dpl, HEAD_DIM**-0.5,
                     page_size=kernel_page)  # fmt: skip
    out = dout.cpu()
    return max(
        _rel_err(out[b : b + 1], _reference(q[b : b + 1], k_buf, v_buf, table,
                                            int(req_rows[b]), n, torch.tensor([n - 1])))
        for b, n in enumerate(lens)
    )  # fmt: skip


# Pages smaller than the kernels' key block (one table load per page) and larger than it (one
# load per block, starting inside a page): the CPU block is 16, the GPU's 64 and 128.
OTHER_PAGE_SIZES = [256] if GPU else [4, 32]


@pytest.mark.parametrize("page_size", OTHER_PAGE_SIZES)
def test_kernels_with_pages_smaller_or_larger_than_a_block(page_size: int) -> None:
    lens = [1, 3, page_size - 1, page_size + 1, 2 * page_size + 5, 70]
    assert _decode_err(lens, 4, page_size, page_size) < _tolerance(torch.float32)
    cases = [(0, 1), (3, page_size), (page_size + 1, 2 * page_size + 3), (2 * page_size, 7)]
    seq = [p + n for p, n in cases]
    k_buf, v_buf, table, req_rows = _paged_setup(seq, KV_HEADS, torch.float32, 21, page_size)
    ext = [n for _, n in cases]
    starts = [sum(ext[:i]) for i in range(len(ext))]
    q = torch.randn(sum(ext), KV_HEADS * 3, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    meta = [torch.tensor(x, dtype=torch.int32) for x in (seq, ext, starts)]
    dq, dk, dv, dout, dt, drows, dseq, dext, dstarts = _dev(
        q, k_buf, v_buf, torch.full_like(q, float("nan")), table, req_rows, *meta
    )
    extend_attention(dq, dk, dv, dout, dt, drows, dseq, dext, dstarts, max(ext), HEAD_DIM**-0.5,
                     page_size=page_size)  # fmt: skip
    out = dout.cpu()
    for r, (prefix, n) in enumerate(cases):
        rows = slice(starts[r], starts[r] + n)
        ref = _reference(q[rows], k_buf, v_buf, table, int(req_rows[r]), prefix + n,
                         torch.arange(prefix, prefix + n))  # fmt: skip
        assert _rel_err(out[rows], ref) < _tolerance(torch.float32), (prefix, n)


def test_paged_kernel_reads_one_table_entry_per_page() -> None:
    """Over a table whose pages are not contiguous (page size 1 layout), the page-16 kernel
    must go wrong: it takes each page's slots from the page's first entry."""
    lens = [40, 33, 17]
    assert _decode_err(lens, 2, 16, 16) < _tolerance(torch.float32)
    assert _decode_err(lens, 2, 1, 1) < _tolerance(torch.float32)
    assert _decode_err(lens, 2, 1, 16) > 0.1


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_extend_split_mask_and_heavy_first_change_no_bits(page_size: int) -> None:
    """The extend kernel's unmasked pass over the keys before a query block, and its
    last-block-first launch order, give the same bits as one masked pass in launch order."""
    from radixserve.plugins.attention.triton import extend_kernel as ek

    cases = EXTEND_CASES
    seq = [p + n for p, n in cases]
    k_buf, v_buf, table, req_rows = _paged_setup(seq, KV_HEADS, torch.bfloat16, 5, page_size)
    ext = [n for _, n in cases]
    starts = [sum(ext[:i]) for i in range(len(ext))]
    q = torch.randn(sum(ext), KV_HEADS * 4, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    meta = [torch.tensor(x, dtype=torch.int32) for x in (seq, ext, starts)]
    dq, dk, dv, dt, drows, dseq, dext, dstarts = _dev(
        q.to(torch.bfloat16), k_buf, v_buf, table, req_rows, *meta
    )
    cfg = ek.CPU_CONFIG if DEVICE == "cpu" else ek.GPU_CONFIG
    saved = dict(cfg)
    outs = []
    try:
        for flags in (False, True):
            cfg.update(heavy_first=flags, split_mask=flags)
            out = torch.full_like(dq, float("nan"))
            extend_attention(dq, dk, dv, out, dt, drows, dseq, dext, dstarts, max(ext),
                             HEAD_DIM**-0.5, page_size=page_size)  # fmt: skip
            outs.append(out.cpu())
    finally:
        cfg.clear()
        cfg.update(saved)
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])


def test_launch_settings_from_the_environment_string() -> None:
    """RADIXSERVE_TRITON_DECODE / _EXTEND: ``key=value,...`` over the defaults; an unknown key
    is an error, and a fixed split count overrides the one from programs_per_sm."""
    from radixserve.plugins.attention.triton import decode_kernel as dk
    from radixserve.plugins.attention.triton import extend_kernel as ek

    assert dk.decode_config("") == dk.GPU_CONFIG
    cfg = dk.decode_config("splits=3, num_stages=2")
    assert (cfg["splits"], cfg["num_stages"], cfg["block_n"]) == (3, 2, dk.GPU_CONFIG["block_n"])
    assert num_decode_splits(64, 8, 132, cfg) == 3
    assert num_decode_splits(64, 8, 132, dk.decode_config()) == num_decode_splits(64, 8, 132)
    assert ek.extend_config("heavy_first=0")["heavy_first"] == 0
    with pytest.raises(ValueError, match="unknown launch setting"):
        dk.decode_config("blocks=64")
