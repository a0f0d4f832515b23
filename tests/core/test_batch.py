"""core/batch.py: ForwardBatch's sizes and prepare_from_device, which hands device rows and
lengths to a backend that prepares from them (decode or verify graphs) and otherwise prepares
the backend on a host copy of the batch (one decode or ``q_len`` verify rows per request)."""

from __future__ import annotations

from typing import Any

import torch

from radixserve.core.batch import ForwardBatch, prepare_from_device


class Attention:
    """Records which preparation the batch got."""

    def __init__(self, decode_on_device: bool, verify_on_device: bool) -> None:
        self.prepares_decode_on_device = decode_on_device
        self.prepares_verify_on_device = verify_on_device
        self.calls: list[tuple[Any, ...]] = []

    def prepare_decode_graph(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        self.calls.append(("decode_graph", rows.tolist(), seq_lens.tolist()))

    def prepare_verify_graph(self, rows: torch.Tensor, seq_lens: torch.Tensor, q_len: int) -> None:
        self.calls.append(("verify_graph", rows.tolist(), seq_lens.tolist(), q_len))

    def prepare(self, batch: ForwardBatch) -> None:
        self.calls.append(("prepare", batch))


KV, TABLE = object(), object()


def batch(tokens: int = 3) -> ForwardBatch:
    return ForwardBatch(
        input_ids=torch.arange(tokens), positions=torch.arange(tokens),
        out_cache_loc=torch.arange(tokens), req_pool_indices=torch.tensor([0, 0, 0]),
        req_to_token=torch.zeros(4, 8, dtype=torch.int32), seq_lens=[1, 1, 1],
        extend_lens=[1, 1, 1], num_decode=3, logits_indices=torch.arange(tokens),
        kv_pool=KV, req_to_token_pool=TABLE,  # type: ignore[arg-type]
    )  # fmt: skip


def test_sizes_and_defaults() -> None:
    b = batch(6)
    assert (b.batch_size, b.num_tokens) == (3, 6)
    assert (b.capture_hidden_layers, b.hidden_states, b.hidden_consumed) == ((), None, False)
    assert (b.hidden_rows, b.final_hidden, b.stage_input, b.mm) == (None, None, None, None)
    b.seq_lens = [4]
    assert b.batch_size == 1


def test_a_backend_that_prepares_on_the_device_gets_the_tensors() -> None:
    rows, lens = torch.tensor([2, 0]), torch.tensor([5, 7])
    attention = Attention(decode_on_device=True, verify_on_device=True)
    b = batch()
    assert prepare_from_device(attention, b, rows, lens) is b
    assert prepare_from_device(attention, b, rows, lens, q_len=3) is b
    assert attention.calls == [
        ("decode_graph", [2, 0], [5, 7]),
        ("verify_graph", [2, 0], [5, 7], 3),
    ]


def test_any_other_backend_prepares_a_host_copy() -> None:
    rows, lens = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([5, 7])
    for decode_on_device, verify_on_device, q_len in [
        (False, True, None), (False, False, None), (True, False, 3), (False, False, 3),
    ]:  # fmt: skip
        attention = Attention(decode_on_device, verify_on_device)
        b = batch()
        host = prepare_from_device(attention, b, rows, lens, q_len=q_len)
        assert attention.calls == [("prepare", host)] and host is not b
        assert host.req_pool_indices.tolist() == [2, 0]
        assert host.req_pool_indices.dtype == torch.int64
        assert host.seq_lens == [5, 7]
        assert host.extend_lens == ([1, 1] if q_len is None else [3, 3])
        assert host.num_decode == (2 if q_len is None else 0)
        assert host.input_ids is b.input_ids and host.kv_pool is KV
        assert host.req_to_token_pool is TABLE
        assert b.seq_lens == [1, 1, 1] and b.num_decode == 3  # the original is left as it was
