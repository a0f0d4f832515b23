"""ReqToTokenPool's write journal (tensor parallelism: the leader's table writes, replayed on
the other ranks' tables and their device mirrors) and TokenAllocator edge sizes: a pool of one
page, pages of 2 tokens, the fresh pages a decode batch needs."""

from __future__ import annotations

import pytest
import torch

from radixserve.core.memory import KVPool, ReqToTokenPool, TokenAllocator

COLS = 16


def test_take_writes_returns_each_write_since_the_last_call_with_its_last_value() -> None:
    leader = ReqToTokenPool(4, COLS)
    with pytest.raises(AssertionError, match=r"record_writes\(\) first"):
        leader.take_writes()
    leader.write(0, 0, torch.tensor([3, 4]))  # before recording: not journaled
    leader.record_writes()
    where, values = leader.take_writes()
    assert where.dtype == values.dtype == torch.int64 and where.numel() == values.numel() == 0
    leader.write(1, 2, torch.tensor([5, 6, 7]))
    where, values = leader.take_writes()
    assert where.tolist() == [COLS + 2, COLS + 3, COLS + 4] and values.tolist() == [5, 6, 7]
    assert leader.take_writes()[0].numel() == 0  # taken once
    leader.write(0, 0, torch.tensor([1, 2]))
    leader.write_points(torch.tensor([2]), torch.tensor([3]), torch.tensor([9]))
    leader.write(0, 1, torch.tensor([8]))  # position 1 again
    where, values = leader.take_writes()
    assert list(zip(where.tolist(), values.tolist(), strict=True)) == [
        (0, 1), (1, 8), (2 * COLS + 3, 9), (1, 8)
    ]  # fmt: skip


def test_apply_writes_replays_another_tables_writes_here_and_on_the_mirror() -> None:
    leader, follower = ReqToTokenPool(4, COLS), ReqToTokenPool(4, COLS)
    leader.record_writes()
    mirror = follower.device_table("cpu")
    follower.apply_writes(*leader.take_writes())  # nothing written: nothing changes
    leader.write(1, 0, torch.tensor([11, 12, 13]))
    follower.apply_writes(*leader.take_writes())
    leader.write(3, 5, torch.tensor([21]))
    leader.write_points(torch.tensor([0, 2]), torch.tensor([1, 1]), torch.tensor([31, 32]))
    follower.apply_writes(*leader.take_writes())
    assert torch.equal(follower.table, leader.table)
    assert follower.device_table("cpu") is mirror
    assert torch.equal(mirror[:4], leader.table.to(torch.int32))


def test_the_mirror_gets_every_write_of_several_since_its_last_sync() -> None:
    pool = ReqToTokenPool(3, COLS)
    mirror = pool.device_table("cpu")
    pool.write(0, 0, torch.tensor([1, 2]))
    pool.write(2, 4, torch.tensor([7]))
    pool.write_points(torch.tensor([1]), torch.tensor([9]), torch.tensor([5]))
    pool.sync()
    assert torch.equal(mirror[:3], pool.table.to(torch.int32))
    assert mirror[3].tolist() == [0] * COLS  # the padding row


def test_a_pool_of_exactly_one_page_is_allowed() -> None:
    assert TokenAllocator(1).size == 1  # slot 1; slot 0 is reserved
    one = TokenAllocator(2 * 4 - 1, 4)  # rows 0..7: page 1 only
    assert one.size == one.available() == 4
    with pytest.raises(ValueError, match="holds no page"):
        TokenAllocator(2 * 4 - 2, 4)


def test_pages_of_two_tokens() -> None:
    alloc = TokenAllocator(20, 2)  # rows 0..20: pages 1..9, 18 slots
    assert alloc.size == 18
    table = torch.zeros((2, 16), dtype=torch.int64)
    slots = alloc.alloc_extend(table[0], 0, 3)  # pages 1 and 2
    assert slots is not None and slots.tolist() == [2, 3, 4]
    table[0, :3] = slots
    more = alloc.alloc_extend(table[0], 3, 2)  # the rest of page 2, then page 3
    assert more is not None and more.tolist() == [5, 6]
    table[0, 3:5] = more
    row1 = alloc.alloc_extend(table[1], 0, 6)  # pages 4..6
    assert row1 is not None and row1.tolist() == [8, 9, 10, 11, 12, 13]
    table[1, :6] = row1
    assert alloc.available() == 6
    lens = torch.tensor([5, 6])
    assert alloc.tokens_needed_decode(lens) == 2  # only row 1 starts a page
    assert alloc.tokens_needed_decode(torch.tensor([5, 7])) == 0  # both inside a page
    dec = alloc.alloc_decode(table, torch.tensor([0, 1]), lens)
    assert dec is not None and dec.tolist() == [7, 14]  # page 3's second slot; page 7
    assert alloc.available() == 4
    got = alloc.alloc(3)  # two whole pages
    assert got is not None and len(got) == 3 and alloc.available() == 0
    table[0, 5] = 7
    alloc.free(table[0, :6])  # pages 1..3 back whole
    assert alloc.available() == 6


def test_fresh_pages_a_decode_batch_needs() -> None:
    alloc = TokenAllocator(100, 16)
    assert alloc.tokens_needed_decode(torch.tensor([16, 17, 32])) == 32  # two fresh pages
    assert alloc.tokens_needed_decode(torch.tensor([1, 17])) == 0
    assert TokenAllocator(100).tokens_needed_decode(torch.tensor([16, 17, 32])) == 3


def test_a_kv_pool_pages_single_tokens_unless_told() -> None:
    """Paged attention kernels read ``page_size`` off the pool: 1 unless given."""
    assert KVPool(6, 2, 3, 4, torch.float16, "cpu").page_size == 1
    assert KVPool(6, 2, 3, 4, torch.float16, "cpu", page_size=2).page_size == 2
