"""The batch-invariant pieces of --enable-deterministic-inference, alone: fixed-split attention
(plugins/attention/fixed_split.py) and fixed-block linears (plugins/models/invariant_ops.py).
A row's result must equal, bit for bit, what it gets in any other step, and be the right one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.plugins.attention import fixed_split
from radixserve.plugins.models.invariant_ops import block_linear

HEADS, KV_HEADS, D = 6, 3, 16


def _pool(slots: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(slots, KV_HEADS, D, generator=g).to(dtype)
    v = torch.randn(slots, KV_HEADS, D, generator=g).to(dtype)
    return k, v


def _table(reqs: list[tuple[int, int, int]], slot_rows: torch.Tensor) -> fixed_split.RowTable:
    return fixed_split.row_table(reqs, slot_rows, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_across_steps_and_match_sdpa(dtype: torch.dtype) -> None:
    """One 150-token sequence: as one prefill, as a cached prefix + extend of 70, as decodes
    one by one, and beside another request: every row bit-identical; all close to SDPA."""
    total = 150
    k_buf, v_buf = _pool(400, dtype)
    slot_rows = torch.zeros(3, 512, dtype=torch.int64)
    slot_rows[0, :total] = torch.randperm(400)[:total]  # scattered slots, as a pool's
    slot_rows[1, :90] = torch.randperm(400)[:90]
    q = torch.randn(total, HEADS, D).to(dtype)
    prefill = fixed_split.attend(q, k_buf, v_buf, _table([(0, total, total)], slot_rows), 0.25)
    extend = fixed_split.attend(q[80:], k_buf, v_buf, _table([(0, 70, total)], slot_rows), 0.25)
    assert torch.equal(extend, prefill[80:])
    for pos in (0, 63, 64, 149):  # decodes, at and around the split edges
        one = fixed_split.attend(
            q[pos : pos + 1], k_buf, v_buf, _table([(0, 1, pos + 1)], slot_rows), 0.25
        )
        assert torch.equal(one[0], prefill[pos])
    # beside another request's 90-token prefill, in the same query blocks
    other = torch.randn(90, HEADS, D).to(dtype)
    both = fixed_split.attend(
        torch.cat([other, q[100:]]), k_buf, v_buf,
        _table([(1, 90, 90), (0, 50, total)], slot_rows), 0.25,
    )  # fmt: skip
    assert torch.equal(both[90:], prefill[100:])
    # the right attention: causal SDPA over the gathered keys, float32
    keys = slot_rows[0, :total]
    kk = k_buf[keys].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    vv = v_buf[keys].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), kk, vv, is_causal=True, scale=0.25
    ).transpose(0, 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(prefill.float(), ref, atol=tol, rtol=tol)


def test_window_and_softcap_match_the_reference() -> None:
    total, window, cap = 100, 20, 5.0
    k_buf, v_buf = _pool(total, torch.float32)
    slot_rows = torch.arange(total)[None, :].clone()
    q = torch.randn(total, HEADS, D) * 3
    got = fixed_split.attend(
        q, k_buf, v_buf, _table([(0, total, total)], slot_rows), 0.25, window=window,
        softcap=cap,
    )  # fmt: skip
    kk = k_buf.repeat_interleave(2, 1).transpose(0, 1)
    vv = v_buf.repeat_interleave(2, 1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), kk.transpose(1, 2)) * 0.25
    scores = torch.tanh(scores / cap) * cap
    pos = torch.arange(total)
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    ref = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ vv
    torch.testing.assert_close(got, ref.transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_linear_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """A row's product is the same alone, at every position of a block, and in batches of
    any size; float32 F.linear itself is not (MKL's matrix-vector product at one row)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(768, 576, generator=g).to(dtype)
    x = torch.randn(200, 576, generator=g).to(dtype)
    alone = [block_linear(x[i : i + 1], w, None, 8)[0] for i in range(0, 200, 37)]
    for n in (2, 7, 8, 9, 64, 200):
        batch = block_linear(x[:n], w, None, 8)
        for j, i in enumerate(range(0, 200, 37)):
            if i < n:
                assert torch.equal(batch[i], alone[j]), (n, i)
    torch.testing.assert_close(
        block_linear(x, w, None, 8).float(), F.linear(x, w).float(), atol=0.5, rtol=2e-2
    )


def test_cpu_panel_linears_are_batch_invariant() -> None:
    """The AVX2 panel kernel deterministic mode keeps for float32 (it declares
    ``batch_invariant``): a row's product is the same in batches of any size and offset."""
    from radixserve.plugins.hardware.cpu_linear import PanelPacking, default_packing

    if not isinstance(default_packing(), PanelPacking):
        pytest.skip("radixserve's AVX2 kernels do not run here")
    packing = PanelPacking()
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1000, 576, generator=g), torch.randn(300, 576, generator=g)
    packed = packing.pack(w)
    full = packing(x, packed, 1000, None)
    for n in (1, 5, 6, 7, 64, 299):
        for offset in (0, 1):
            rows = x[offset : offset + n].contiguous()
            assert torch.equal(packing(rows, packed, 1000, None), full[offset : offset + n])


def test_the_row_block_follows_the_device_unless_the_environment_sets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from radixserve.plugins.models.invariant_ops import CPU_ROW_BLOCK, GPU_ROW_BLOCK, row_block_for

    monkeypatch.delenv("RADIXSERVE_INVARIANT_ROW_BLOCK", raising=False)
    assert (row_block_for("cpu"), row_block_for("cuda")) == (CPU_ROW_BLOCK, GPU_ROW_BLOCK)
    monkeypatch.setenv("RADIXSERVE_INVARIANT_ROW_BLOCK", "128")
    assert row_block_for("cuda") == 128 and row_block_for("cpu") == 128
