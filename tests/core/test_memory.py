"""The paged TokenAllocator: pages fill in order, a failed allocation changes nothing, frees
give back whole pages, page 0 (slot 0) is never handed out; and a property-based run of many
requests extending, decoding and finishing against the layout invariant."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.core.memory import ReqToTokenPool, TokenAllocator, to_device

P = 16


def assert_paged(row: torch.Tensor, n: int, page_size: int) -> None:
    """Positions [k * P, (k + 1) * P) of the row sit in one page, in order."""
    slots = row[:n]
    pos = torch.arange(n)
    first = slots[pos - pos % page_size]
    assert torch.equal(slots, first + pos % page_size), slots.tolist()
    assert bool((first % page_size == 0).all()), slots.tolist()


def test_size_counts_whole_pages_past_the_reserved_one() -> None:
    alloc = TokenAllocator(10 * P + 3, P)  # KV rows 0..163: pages 0..9 fit, page 0 is reserved
    assert alloc.size == alloc.available() == 9 * P
    assert TokenAllocator(100).size == 100  # page size 1: slots 1..100
    with pytest.raises(ValueError, match="holds no page"):
        TokenAllocator(P, P)


def test_page_zero_is_never_handed_out() -> None:
    alloc = TokenAllocator(8 * P - 1, P)
    slots = alloc.alloc(alloc.size)
    assert slots is not None and len(slots) == 7 * P
    assert int(slots.min()) == P and int(slots.max()) == 8 * P - 1
    assert sorted(slots.tolist()) == list(range(P, 8 * P))
    assert alloc.alloc(1) is None


def test_extend_fills_the_partial_last_page_before_taking_new_pages() -> None:
    alloc = TokenAllocator(8 * P - 1, P)
    row = torch.zeros(64, dtype=torch.int64)
    first = alloc.alloc_extend(row, 0, 5)
    assert first is not None and len(first) == 5
    row[:5] = first
    assert alloc.available() == 6 * P  # one page taken for five tokens
    more = alloc.alloc_extend(row, 5, 20)  # 11 fill the first page, 9 start a second
    assert more is not None
    row[5:25] = more
    assert more[:11].tolist() == list(range(int(first[0]) + 5, int(first[0]) + P))
    assert alloc.available() == 5 * P
    assert_paged(row, 25, P)
    exact = alloc.alloc_extend(row, 25, 7)  # exactly fills the second page: no new page
    assert exact is not None and alloc.available() == 5 * P
    row[25:32] = exact
    assert_paged(row, 32, P)
    assert alloc.tokens_needed(32, 1) == P and alloc.tokens_needed(25, 7) == 0
    assert alloc.tokens_needed(5, 20) == P and alloc.tokens_needed(0, 33) == 3 * P


def test_decode_takes_a_new_page_only_at_a_page_boundary() -> None:
    alloc = TokenAllocator(16 * P - 1, P)
    table = torch.zeros(4, 64, dtype=torch.int64)
    lens = [P, P + 1, 2 * P - 1, 2 * P]
    for r, n in enumerate(lens):
        slots = alloc.alloc_extend(table[r], 0, n)
        assert slots is not None
        table[r, :n] = slots
    before = alloc.available()
    rows, kv_lens = torch.arange(4), torch.tensor(lens)
    assert alloc.tokens_needed_decode(kv_lens) == 2 * P
    slots = alloc.alloc_decode(table, rows, kv_lens)
    assert slots is not None
    assert alloc.available() == before - 2 * P  # rows 0 and 3 started pages
    assert slots[1] == table[1, P] + 1 and slots[2] == table[2, 2 * P - 2] + 1
    assert slots[0] % P == 0 and slots[3] % P == 0 and slots[0] != slots[3]
    table[rows, kv_lens] = slots
    for r, n in enumerate(lens):
        assert_paged(table[r], n + 1, P)


@pytest.mark.parametrize("page_size", [1, P])
def test_failed_allocation_changes_nothing(page_size: int) -> None:
    p = page_size
    alloc = TokenAllocator(4 * p - 1 if p > 1 else 3, p)  # three pages
    table = torch.zeros(2, 64, dtype=torch.int64)
    for r, n in enumerate([2 * p, p]):
        slots = alloc.alloc_extend(table[r], 0, n)
        assert slots is not None
        table[r, :n] = slots
    assert alloc.available() == 0
    assert alloc.alloc_extend(table[0], 2 * p, 1) is None
    assert alloc.alloc(1) is None
    assert alloc.alloc_decode(table, torch.tensor([0, 1]), torch.tensor([2 * p, p])) is None
    assert alloc.available() == 0
    alloc.free(table[1, :p].clone())
    assert alloc.available() == p
    # The failures took nothing: the one free page is the one just given back.
    again = alloc.alloc(p)
    assert again is not None and again.tolist() == table[1, :p].tolist()


def test_free_gives_back_whole_pages_including_a_partial_last_one() -> None:
    alloc = TokenAllocator(8 * P - 1, P)
    row = torch.zeros(64, dtype=torch.int64)
    slots = alloc.alloc_extend(row, 0, 2 * P + 3)
    assert slots is not None and alloc.available() == 4 * P
    alloc.free(slots[2 * P :])  # the partial third page
    assert alloc.available() == 5 * P
    alloc.free(slots[: 2 * P])
    assert alloc.available() == 7 * P
    again = alloc.alloc(alloc.size)
    assert again is not None and sorted(again.tolist()) == list(range(P, 8 * P))


def test_page_size_1_decode_and_free_are_plain_slots() -> None:
    alloc = TokenAllocator(10)
    table = torch.zeros(3, 8, dtype=torch.int64)
    slots = alloc.alloc_decode(table, torch.arange(3), torch.tensor([1, 2, 3]))
    assert slots is not None and sorted(slots.tolist()) == [1, 2, 3]
    assert alloc.available() == 7
    alloc.free(slots[1:])
    assert alloc.available() == 9


# -- property-based: many requests against the layout invariant ------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["extend", "decode", "finish"]), st.integers(0, 3), st.integers(1, 40)
    ),
    max_size=60,
)


@settings(max_examples=120, deadline=None)
@given(page_size=st.sampled_from([1, 4, P]), ops=ops)
def test_requests_keep_the_page_layout_and_never_share_a_slot(
    page_size: int, ops: list[tuple[str, int, int]]
) -> None:
    alloc = TokenAllocator(12 * page_size - 1 if page_size > 1 else 40, page_size)
    table = torch.zeros(4, 512, dtype=torch.int64)
    lens = [0, 0, 0, 0]
    for op, r, n in ops:
        before = alloc.available()
        if op == "extend":
            slots = alloc.alloc_extend(table[r], lens[r], n)
            if slots is None:
                assert alloc.available() == before
                assert alloc.tokens_needed(lens[r], n) > before
                continue
            table[r, lens[r] : lens[r] + n] = slots
            lens[r] += n
        elif op == "decode":
            active = [i for i in range(4) if lens[i]]
            if not active:
                continue
            rows = torch.tensor(active)
            kv = torch.tensor([lens[i] for i in active])
            slots = alloc.alloc_decode(table, rows, kv)
            if slots is None:
                assert alloc.available() == before
                assert alloc.tokens_needed_decode(kv) > before
                continue
            table[rows, kv] = slots
            for i in active:
                lens[i] += 1
        else:
            alloc.free(table[r, : lens[r]].clone())
            lens[r] = 0
        used = [s for i in range(4) for s in table[i, : lens[i]].tolist()]
        assert len(set(used)) == len(used), "two positions share a slot"
        assert min(used, default=page_size) >= page_size, "page 0 was handed out"
        pages = sum(-(-n // page_size) for n in lens)
        assert alloc.available() == alloc.size - pages * page_size
        for i in range(4):
            assert_paged(table[i], lens[i], page_size)


def test_req_to_token_mirror_follows_every_write() -> None:
    """The device mirror (on the CPU here) equals the host table after each sync, whatever the
    order of writes; a position written twice before a sync keeps its last value."""
    pool = ReqToTokenPool(3, 8)
    pool.write(0, 0, torch.tensor([5, 6, 7]))  # before the mirror exists: copied whole
    mirror = pool.device_table("cpu")
    assert mirror.shape == (4, 8) and mirror.dtype == torch.int32
    assert pool.pad_row == 3 and not mirror[3].any()
    assert torch.equal(mirror[:3].long(), pool.table)
    pool.write(1, 2, torch.tensor([9, 10]))
    pool.write_points(torch.tensor([0, 1]), torch.tensor([3, 4]), torch.tensor([11, 12]))
    pool.write(0, 1, torch.tensor([20, 21]))  # rewrites positions 1 and 2 of row 0
    pool.write(0, 2, torch.tensor([22]))  # and position 2 once more
    assert mirror[0, 2] == 7, "writes reach the mirror only at a sync"
    pool.sync()
    assert torch.equal(mirror[:3].long(), pool.table)
    assert mirror[0, :4].tolist() == [5, 20, 22, 11]
    assert pool.device_table("cpu") is mirror, "one tensor for the pool's life (CUDA graphs)"


def test_req_to_token_rows_are_handed_out_in_order_and_reused() -> None:
    pool = ReqToTokenPool(3, 8)
    assert pool.table.shape == (3, 8) and pool.table.dtype == torch.int64
    assert not pool.table.any() and pool.max_context == 8
    assert [pool.alloc(), pool.alloc(), pool.alloc()] == [0, 1, 2]
    assert pool.alloc() is None and pool.available() == 0
    pool.free(1)
    assert pool.available() == 1 and pool.alloc() == 1
    pool.write(2, 0, torch.tensor([], dtype=torch.int64))  # nothing to write
    assert not pool.table.any()
    pool.sync()  # no mirror, no writes: nothing to do


def test_reserved_rows_are_the_last_ones_and_never_handed_out() -> None:
    pool = ReqToTokenPool(5, 8)
    assert pool.reserve(0) == []
    assert pool.reserve(2) == [4, 3]  # scratch rows for the step strategies, taken for good
    assert pool.available() == 3
    assert [pool.alloc(), pool.alloc(), pool.alloc()] == [0, 1, 2]
    assert pool.alloc() is None
    pool.free(3)
    with pytest.raises(ValueError, match="2 scratch rows asked, 1 free"):
        pool.reserve(2)
    assert pool.available() == 1  # a refused reservation takes nothing


def test_to_device_leaves_a_host_tensor_as_it_is() -> None:
    tensor = torch.arange(4)
    assert to_device(tensor, "cpu") is tensor
    assert to_device(tensor, torch.device("cpu")) is tensor


def test_req_to_token_mirror_is_pinned_to_its_device() -> None:
    pool = ReqToTokenPool(2, 4)
    mirror = pool.device_table(torch.device("cpu"))
    pool.write(1, 3, torch.tensor([9]))
    assert pool.device_table("cpu")[1, 3] == 9 and pool.device_table("cpu") is mirror
    with pytest.raises(ValueError, match="lives on cpu, not on meta"):
        pool.device_table("meta")


def test_kv_pool_buffers_per_layer() -> None:
    from radixserve.core.memory import KVPool

    pool = KVPool(6, 2, 3, 4, torch.float16, "cpu", page_size=2)
    assert pool.size == 6 and pool.page_size == 2
    assert len(pool.k) == len(pool.v) == 2
    for buf in (*pool.k, *pool.v):
        assert buf.shape == (7, 3, 4) and buf.dtype == torch.float16 and not buf.any()
    assert len({id(b) for b in (*pool.k, *pool.v)}) == 4, "every buffer its own tensor"
    k, v = torch.ones(2, 3, 4), torch.full((2, 3, 4), 2.0)
    pool.store(1, torch.tensor([2, 5]), k.half(), v.half())
    assert pool.k[1][[2, 5]].eq(1).all() and pool.v[1][[2, 5]].eq(2).all()
    assert not pool.k[1][[0, 1, 3, 4, 6]].any() and not pool.v[1][[0, 1, 3, 4, 6]].any()
    assert not pool.k[0].any() and not pool.v[0].any()
    assert KVPool.bytes_per_token(2, 3, 4, torch.float16) == 2 * 2 * 3 * 4 * 2
    assert KVPool.bytes_per_token(30, 3, 64, torch.float32) == 2 * 30 * 3 * 64 * 4


def test_kv_pool_keeps_its_compute_dtype_and_rounds_a_wider_store() -> None:
    from radixserve.core.memory import KVPool

    pool = KVPool(4, 1, 1, 2, torch.float16, "cpu")
    assert pool.compute_dtype == torch.float16 and not pool.saturate
    assert pool.k_scales == [1.0] and pool.v_scales == [1.0]
    narrow = KVPool(4, 1, 1, 2, torch.float16, "cpu", compute_dtype=torch.float32)
    assert narrow.compute_dtype == torch.float32
    k = torch.tensor([[[1.0001, -3.0]]])
    narrow.store(0, torch.tensor([3]), k, -k)
    assert narrow.k[0][3].dtype == torch.float16
    assert torch.equal(narrow.k[0][3], k[0].half()) and torch.equal(narrow.v[0][3], -k[0].half())


def test_fp8_kv_pool_stores_divided_by_its_layer_scales_and_clamped() -> None:
    from radixserve.core.memory import KVPool

    fp8 = torch.float8_e4m3fn
    pool = KVPool(4, 2, 1, 4, fp8, "cpu", compute_dtype=torch.bfloat16)
    assert pool.saturate
    pool.set_scales(1, 2, 0.5)
    assert pool.k_scales == [1.0, 2.0] and pool.v_scales == [1.0, 0.5]
    assert isinstance(pool.k_scales[1], float)
    top = torch.finfo(fp8).max  # 448
    k = torch.tensor([[[4.0, -8.0, 2000.0, -2000.0]]])
    v = torch.tensor([[[1.0, -2.0, 300.0, -300.0]]])
    for layer, (k_scale, v_scale) in enumerate([(1.0, 1.0), (2.0, 0.5)]):
        pool.store(layer, torch.tensor([2]), k, v)
        got_k, got_v = pool.k[layer][2].float(), pool.v[layer][2].float()
        assert not got_k.isnan().any() and not got_v.isnan().any(), "overflow clamps, not NaN"
        want_k = (k[0] / k_scale).clamp(-top, top).to(fp8).float()
        want_v = (v[0] / v_scale).clamp(-top, top).to(fp8).float()
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert not pool.k[layer][[0, 1, 3, 4]].float().any()
    assert pool.k[1][2, 0, 0].item() == 2.0 and pool.v[1][2, 0, 1].item() == -4.0
    assert pool.k[0][2, 0, 2].item() == top and pool.v[1][2, 0, 3].item() == -top


def test_free_counts_move_for_every_slot_of_a_freed_page() -> None:
    """A drafter trusts its KV at a slot while the slot's free count has not moved: freeing a
    request's slots moves the count of every slot of their pages (a partial last page goes back
    whole), and of no other."""
    alloc = TokenAllocator(64, page_size=4)
    kept = alloc.alloc(8)
    slots = alloc.alloc(6)  # a page and a half
    assert kept is not None and slots is not None
    before = alloc.free_counts(torch.arange(alloc.size + 4))
    alloc.free(slots)
    after = alloc.free_counts(torch.arange(alloc.size + 4))
    moved = set(torch.nonzero(after != before).flatten().tolist())
    pages = {int(s) // 4 for s in slots}
    assert moved == {p * 4 + i for p in pages for i in range(4)}
    assert not moved & set(kept.tolist())
