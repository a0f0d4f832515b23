"""StepRows alone (core/step_rows.py): the rows of one step's ForwardBatch as the model runner
and a step strategy add them, and their packing, on real requests, a real slot table and KV
pool on the CPU. Every index the batch carries is checked exactly (milliseconds a test)."""

from __future__ import annotations

import pytest
import torch

from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.core.request import Req, SamplingParams
from radixserve.core.step_rows import LogitsPlan, StepRows

MAX_CONTEXT = 16


@pytest.fixture
def table() -> ReqToTokenPool:
    """Four rows; row r's position p holds slot 100 * (r + 1) + p (distinct everywhere)."""
    pool = ReqToTokenPool(4, MAX_CONTEXT)
    for r in range(4):
        pool.table[r] = torch.arange(MAX_CONTEXT) + 100 * (r + 1)
    return pool


@pytest.fixture
def kv_pool() -> KVPool:
    return KVPool(8, 1, 1, 2, torch.float32, "cpu")


def req(row: int, prompt: list[int], output: list[int] = (), kv_len: int = 0) -> Req:
    r = Req(f"r{row}", list(prompt), SamplingParams(max_new_tokens=8))
    r.output_ids = list(output)
    r.req_pool_idx = row
    r.kv_len = kv_len
    return r


def test_a_decode_reads_its_token_from_the_prompt_or_the_output() -> None:
    rows = StepRows()
    rows.add_decode(req(2, [11, 12, 13], [21, 22], kv_len=4))  # position 4: output[1]
    rows.add_decode(req(1, [31, 32, 33, 34], kv_len=2))  # position 2: the prompt's
    rows.add_decode(req(0, [41, 42], [51], kv_len=2))  # position 2 == prompt_len: output[0]
    assert rows.input_ids == [22, 33, 51]
    assert rows.positions == [4, 2, 2]
    assert rows.rows == [2, 1, 0]
    assert rows.pool_rows == [2, 1, 0]
    assert rows.seq_lens == [5, 3, 3]
    assert rows.logits_rows == [0, 1, 2]
    assert rows.plans == [LogitsPlan(range(0), i, i) for i in range(3)]
    assert rows.future_dst == [] and rows.future_src == []


def test_a_pending_decode_reads_the_previous_steps_sampled_id(
    table: ReqToTokenPool, kv_pool: KVPool
) -> None:
    rows = StepRows()
    rows.add_decode(req(0, [5, 6], [7], kv_len=2))
    for row, pending_row in ((3, 2), (1, 0)):
        pending = req(row, [5, 6, 7], kv_len=3)
        pending.num_pending, pending.pending_row = 1, pending_row
        rows.add_decode(pending)
    assert rows.input_ids == [7, 0, 0]  # placeholders until the device fills them in
    assert rows.future_dst == [1, 2] and rows.future_src == [2, 0]
    prev_ids = torch.tensor([90, 91, 92, 93])
    fb = rows.forward_batch([1, 1, 1], 3, table, kv_pool, "cpu", prev_ids)
    assert fb.input_ids.tolist() == [7, 92, 90]
    assert fb.positions.tolist() == [2, 3, 3]
    assert fb.out_cache_loc.tolist() == [102, 403, 203]
    assert fb.logits_indices.tolist() == [0, 1, 2]
    with pytest.raises(AssertionError, match="^a pending token needs the previous step's ids$"):
        rows.forward_batch([1, 1, 1], 3, table, kv_pool, "cpu", None)


def test_an_extend_chunk_and_its_scored_positions() -> None:
    rows = StepRows()
    rows.add_decode(req(0, [1, 2], [3], kv_len=2))
    chunk = req(1, [10, 11, 12, 13, 14, 15], kv_len=2)
    chunk.logprob_start_len = 3  # score prompt tokens from position 3: logits of 2, 3, 4
    rows.add_extend(chunk, 3)  # positions 2, 3, 4
    assert rows.input_ids == [3, 12, 13, 14]
    assert rows.positions == [2, 2, 3, 4]
    assert rows.rows == [0, 1, 1, 1]
    assert rows.pool_rows == [0, 1]
    assert rows.seq_lens == [3, 5]
    # flattened rows: the decode is 0, the chunk's positions 2, 3, 4 are rows 1, 2, 3
    assert rows.logits_rows == [0, 1, 2, 3, 3]
    assert rows.plans[1] == LogitsPlan(range(2, 5), 1, 4)


def test_an_extend_that_scores_nothing_keeps_only_its_last_token() -> None:
    rows = StepRows()
    rows.add_extend(req(0, [10, 11, 12, 13], [20], kv_len=3), 2)  # prompt end and output
    assert rows.input_ids == [13, 20]
    assert rows.positions == [3, 4]
    assert rows.seq_lens == [5]
    assert rows.logits_rows == [1]
    assert rows.plans == [LogitsPlan(range(0), 0, 0)]


def test_add_sequence_returns_the_flattened_row_of_position_zero() -> None:
    rows = StepRows()
    rows.positions += [0, 0]  # two rows before it
    offset = rows.add_sequence(req(2, [1] * 8, kv_len=5), 3)
    assert offset == 2 - 5  # position p is row offset + p: position 5 is row 2
    assert rows.positions[2:] == [5, 6, 7]
    assert rows.rows == [2, 2, 2]
    assert rows.pool_rows == [2] and rows.seq_lens == [8]


def test_decode_rows_of_one_entry_count_as_decodes(table: ReqToTokenPool, kv_pool: KVPool) -> None:
    rows = StepRows()
    rows.add_decode(req(0, [1, 2], kv_len=1))
    rows.input_ids += [8, 9, 10]  # a strategy's entry: three rows attending as decodes
    rows.add_decode_row(1, 4)
    rows.add_decode_row(2, 5)
    rows.add_decode_row(2, 6)
    rows.as_decodes[1] = 3
    assert rows.positions == [1, 4, 5, 6]
    assert rows.seq_lens == [2, 5, 6, 7]
    assert rows.pool_rows == [0, 1, 2, 2]
    assert rows.logits_rows == [0, 1, 2, 3]
    rows.add_extend(req(3, [1, 2, 3, 4], kv_len=1), 2)
    fb = rows.forward_batch([1, 3, 2], 1, table, kv_pool, "cpu", None)
    assert fb.extend_lens == [1, 1, 1, 1, 2]
    assert fb.num_decode == 4
    assert fb.seq_lens == [2, 5, 6, 7, 3]
    assert fb.req_pool_indices.tolist() == [0, 1, 2, 2, 3]
    assert fb.out_cache_loc.tolist() == [101, 204, 305, 306, 401, 402]


def test_a_batch_without_decode_rows_keeps_its_extend_lens(
    table: ReqToTokenPool, kv_pool: KVPool
) -> None:
    rows = StepRows()
    rows.add_decode(req(0, [1, 2], kv_len=1))
    rows.add_extend(req(1, [4, 5, 6], kv_len=0), 3)
    fb = rows.forward_batch([1, 3], 1, table, kv_pool, "cpu", None)
    assert fb.extend_lens == [1, 3] and fb.num_decode == 1
    assert fb.input_ids.tolist() == [2, 4, 5, 6]
    assert fb.positions.tolist() == [1, 0, 1, 2]
    assert fb.out_cache_loc.tolist() == [101, 200, 201, 202]
    assert fb.logits_indices.tolist() == [0, 3]
    assert fb.req_to_token is table.table and fb.req_to_token_pool is table
    assert fb.kv_pool is kv_pool
    assert fb.req_pool_indices.dtype == torch.int64


def test_tokens_still_on_the_device_fill_their_rows(table: ReqToTokenPool, kv_pool: KVPool) -> None:
    """Rows whose tokens a strategy left on the device, one tensor per entry (one or two
    entries: a single tensor is used as it is, several are concatenated), beside a pending
    decode: each source lands in its own rows."""
    for entries in (1, 2):
        rows = StepRows()
        pending = req(0, [1, 2], kv_len=2)
        pending.num_pending, pending.pending_row = 1, 0
        rows.add_decode(pending)
        for e in range(entries):
            r = req(1 + e, [3, 4], kv_len=2)
            at = len(rows.positions)
            rows.input_ids += [4, 0, 0]
            rows.device_dst += [at + 1, at + 2]
            rows.device_tokens.append(torch.tensor([60 + 10 * e, 61 + 10 * e]))
            rows.add_sequence(r, 3)
            rows.logits_rows += [at, at + 1, at + 2]
        lens = [1] + [3] * entries
        fb = rows.forward_batch(lens, 1, table, kv_pool, "cpu", torch.tensor([77]))
        want = [77, 4, 60, 61] + ([4, 70, 71] if entries == 2 else [])
        assert fb.input_ids.tolist() == want
        assert fb.positions.tolist() == [2] + [2, 3, 4] * entries
        assert fb.logits_indices.tolist() == list(range(1 + 3 * entries))
