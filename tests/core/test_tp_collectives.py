"""Tensor parallelism's collectives (core/parallel.py, core/distributed.py, core/tp_step.py)
without processes: a
platform's fast all-reduce is tried first and the backend's takes what it declines; it is used
on every rank or on none; leaving a group that does not close gives up after a limit, never
hangs; and a follower rebuilds each step the leader broadcast, small or large."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from radixserve.core import distributed
from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.parallel import TensorParallel


class FakeFast:
    """Takes tensors of at most ``limit`` elements (doubles them: two ranks of equal values)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.closed = False

    def __call__(self, x: torch.Tensor) -> bool:
        if x.numel() > self.limit:
            return False
        x.mul_(2)
        return True

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def backend_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """torch.distributed.all_reduce replaced by a recorder that sums two equal ranks."""
    calls: list[Any] = []

    def all_reduce(x: torch.Tensor, op: Any = None, group: Any = None) -> None:
        calls.append((tuple(x.shape), op, group))
        if op is None:
            x.mul_(2)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return calls


def test_the_fast_all_reduce_takes_what_it_can_and_the_backend_the_rest(
    backend_calls: list[Any],
) -> None:
    tp = TensorParallel(0, 2, group="device-group", fast_all_reduce=FakeFast(limit=8))
    small, large = torch.ones(2, 4), torch.ones(3, 4)
    assert tp.all_reduce(small) is small and torch.equal(small, torch.full((2, 4), 2.0))
    assert backend_calls == []
    assert tp.all_reduce(large) is large and torch.equal(large, torch.full((3, 4), 2.0))
    assert backend_calls == [((3, 4), None, "device-group")]


class Platform:
    def __init__(self, fast: Any) -> None:
        self.fast = fast

    def fast_all_reduce(self, group: Any, size: int) -> Any:
        if isinstance(self.fast, Exception):
            raise self.fast
        return self.fast

    def distributed_backend(self) -> str:
        return "nccl"


def _agree(platform: Any, others_have_it: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """_agreed_fast_all_reduce on this rank; the other rank has one or not."""

    def all_reduce(x: torch.Tensor, op: Any = None, group: Any = None) -> None:
        assert group == "cpu-group" and op == torch.distributed.ReduceOp.MIN
        x.fill_(min(int(x.item()), int(others_have_it)))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return distributed._agreed_fast_all_reduce(platform, "group", 2, "cpu-group", True)


def test_the_fast_all_reduce_runs_on_every_rank_or_on_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = FakeFast(8)
    assert _agree(Platform(fast), True, monkeypatch) is fast
    assert _agree(Platform(fast), False, monkeypatch) is None
    assert fast.closed  # this rank's buffers go when another rank has none
    # a platform that fails to build one: the backend's all-reduce, this rank and the others
    assert _agree(Platform(RuntimeError("no peer access")), True, monkeypatch) is None


def test_disabled_the_platform_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, op=None, group=None: None)
    platform = Platform(RuntimeError("must not be called"))
    assert distributed._agreed_fast_all_reduce(platform, "g", 2, "cpu", False) is None


def test_a_group_that_does_not_close_is_left_open_not_waited_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", release.wait)
    monkeypatch.setattr(distributed, "TEARDOWN_TIMEOUT_S", 0.2)
    fast = FakeFast(8)
    group = TensorParallel(0, 2, fast_all_reduce=fast)
    ranks = distributed.Ranks(group, torch.get_num_threads())
    config = EngineConfig(tp_size=2)
    try:
        ranks.close()  # returns after the limit
        assert fast.closed and group.fast_all_reduce is None
        with pytest.raises(ConfigError, match="did not close; start a tensor-parallel engine"):
            distributed.join(Platform(None), config, distributed.Rendezvous("file:///x", 0, 2))  # type: ignore[arg-type]
        ranks.close()  # a second close does nothing (no second closing thread)
        assert sum(t.name == distributed._CLOSER_THREAD for t in threading.enumerate()) == 1
    finally:
        release.set()
    for t in threading.enumerate():
        if t.name == distributed._CLOSER_THREAD:
            t.join(5)
    # once the group has closed after all, a new engine may start here again: the refusal
    # came from the closing thread still running, not from a flag that stays set
    assert not distributed._stuck()


# ---- the per-step broadcast (core/tp_step.py), through a fake broadcast ----------------------


def _batch(pool: Any, rows: list[int], lens: list[int], new: list[int]) -> ForwardBatch:
    t = sum(new)
    for row, n, k in zip(rows, lens, new, strict=True):
        pool.write(row, n - k, torch.arange(k, dtype=torch.int64) + 100 * row + n - k)
    return ForwardBatch(
        input_ids=torch.arange(t) + 7, positions=torch.arange(t) % 5,
        out_cache_loc=torch.arange(t) + 3, req_pool_indices=torch.tensor(rows),
        req_to_token=pool.table, seq_lens=lens, extend_lens=new,
        num_decode=sum(1 for k in new if k == 1), logits_indices=torch.tensor([t - 1]),
        kv_pool=None, req_to_token_pool=pool,
    )  # fmt: skip


def test_followers_get_each_step_as_the_leader_ran_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.core.memory import ReqToTokenPool
    from radixserve.core.tp_step import MESSAGE, StepBroadcaster, follow_steps

    sent: list[torch.Tensor] = []  # the leader's messages, in order
    monkeypatch.setattr(
        torch.distributed, "broadcast", lambda t, src, group=None: sent.append(t.clone())
    )
    leader_pool, follower_pool = ReqToTokenPool(4, 4096), ReqToTokenPool(4, 4096)
    ran: list[ForwardBatch] = []
    leader = StepBroadcaster(TensorParallel(0, 2), leader_pool, "cpu", ran.append)  # type: ignore[arg-type]
    # a decode step (its metadata inline in the first message) and a 3,000-token prefill (not)
    for rows, lens, new in (([0, 1], [5, 9], [1, 1]), ([2], [3000], [3000])):
        leader(_batch(leader_pool, rows, lens, new))
    leader.stop()
    # the decode's message, the prefill's and its metadata (2 x 3,000 writes, 3 x 3,000 device
    # ints on a CPU device: they ride along), the stop
    sizes = [m.numel() for m in sent]
    assert sizes[:2] == [MESSAGE, MESSAGE] and sizes[2] > MESSAGE and sizes[3:] == [MESSAGE]

    def receive(t: torch.Tensor, src: int, group: Any = None) -> None:
        t.copy_(sent.pop(0))

    monkeypatch.setattr(torch.distributed, "broadcast", receive)
    followed: list[ForwardBatch] = []
    steps = follow_steps(TensorParallel(1, 2), follower_pool, None, "cpu", followed.append)  # type: ignore[arg-type]
    assert steps == 2 and not sent
    for a, b in zip(ran, followed, strict=True):
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices",
                     "logits_indices"):  # fmt: skip
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.seq_lens, a.extend_lens, a.num_decode) == (b.seq_lens, b.extend_lens,
                                                              b.num_decode)  # fmt: skip
    assert torch.equal(follower_pool.table, leader_pool.table)


class Wire:
    """A fake broadcast: the leader's sends recorded as (tensor, src, group), then handed to a
    follower's receives in order, each checked for the size and dtype it was sent with."""

    def __init__(self) -> None:
        self.sent: list[tuple[torch.Tensor, Any, Any]] = []

    def send(self, t: torch.Tensor, src: Any, group: Any = "unset") -> None:
        self.sent.append((t.clone(), src, group))

    def receive(self, t: torch.Tensor, src: Any, group: Any = "unset") -> None:
        sent, sent_src, sent_group = self.sent.pop(0)
        assert (src, group) == (sent_src, sent_group)
        assert (t.dtype, t.numel()) == (sent.dtype, sent.numel())
        t.copy_(sent)


class Executor:
    """A step executor replaying graphs of one length, holding a capture to release."""

    uniform_verify = True

    def __init__(self, fail_on: int = -1) -> None:
        self.ran: list[ForwardBatch] = []
        self.released = 0
        self.fail_on = fail_on

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        self.ran.append(batch)
        if len(self.ran) == self.fail_on:
            raise RuntimeError("the step broke")
        return torch.zeros(1)

    def release(self) -> None:
        self.released += 1


def test_steps_with_hidden_rows_and_failures_reach_the_follower_whole(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from radixserve.core.memory import ReqToTokenPool
    from radixserve.core.tp_step import HEADER, MESSAGE, StepBroadcaster, follow_steps

    wire = Wire()
    monkeypatch.setattr(torch.distributed, "broadcast", wire.send)
    leader_pool, follower_pool = ReqToTokenPool(4, 4096), ReqToTokenPool(4, 4096)
    tp = TensorParallel(0, 2, group="device group", cpu_group="gloo group")
    executor = Executor()
    leader = StepBroadcaster(tp, leader_pool, "cpu", executor)
    assert leader.uniform_verify is True and leader.stopped is False
    plain = StepBroadcaster(tp, ReqToTokenPool(4, 64), "cpu", executor.ran.append)  # type: ignore[arg-type]
    assert plain.uniform_verify is False
    # a 300-token prefill (its metadata inline, more than half the message), then one whose
    # 407 tokens and one hidden row fill the message exactly, then a decode with hidden rows
    steps = (([0], [300], [300], None), ([1], [407], [407], [5]), ([0, 1], [301, 408], [1, 1],
             [0, 1]))  # fmt: skip
    for rows, lens, new, hidden in steps:
        batch = _batch(leader_pool, rows, lens, new)
        batch.hidden_rows = None if hidden is None else torch.tensor(hidden)
        leader(batch)
    leader.stop()
    leader.stop()  # once only
    assert leader.stopped is True
    assert [(t.numel(), t.dtype, src, group) for t, src, group in wire.sent] == [
        (MESSAGE, torch.int64, 0, "gloo group")
    ] * 4
    second = wire.sent[1][0]
    assert second[HEADER - 1] == 1  # inline ...
    assert HEADER + 3 + 2 * 407 + 3 * 407 + 1 + 1 == MESSAGE  # ... though it fills the message

    monkeypatch.setattr(torch.distributed, "broadcast", wire.receive)
    follower = Executor(fail_on=2)
    kv_pool = object()
    with caplog.at_level("ERROR", logger="radixserve.core.tp_step"):
        count = follow_steps(TensorParallel(1, 2, "device group", "gloo group"), follower_pool,
                             kv_pool, "cpu", follower)  # type: ignore[arg-type]  # fmt: skip
    assert count == 3 and not wire.sent  # the failed step counted, the loop went on
    assert [r.getMessage() for r in caplog.records] == [
        "rank 1: a step failed; rank 0 fails its requests"
    ]
    for a, b in zip(executor.ran, follower.ran, strict=True):
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices",
                     "logits_indices"):  # fmt: skip
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        if a.hidden_rows is None:
            assert b.hidden_rows is None
        else:
            assert torch.equal(a.hidden_rows, b.hidden_rows)
        assert b.kv_pool is kv_pool and b.req_to_token_pool is follower_pool
        assert b.req_to_token is follower_pool.table
    assert torch.equal(follower_pool.table, leader_pool.table)


def test_off_the_cpu_the_device_ints_go_over_the_device_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from radixserve.core.memory import ReqToTokenPool
    from radixserve.core.tp_step import MESSAGE, StepBroadcaster, follow_steps

    wire = Wire()
    monkeypatch.setattr(torch.distributed, "broadcast", wire.send)
    leader_pool, follower_pool = ReqToTokenPool(4, 4096), ReqToTokenPool(4, 4096)
    tp = TensorParallel(0, 2, group="device group", cpu_group="gloo group")
    ran: list[ForwardBatch] = []
    leader = StepBroadcaster(tp, leader_pool, "meta", ran.append)  # type: ignore[arg-type]
    for rows, lens, new, hidden in (([0, 1], [5, 9], [1, 1], [1]), ([2], [1500], [1500], None)):
        batch = _batch(leader_pool, rows, lens, new)
        batch.hidden_rows = None if hidden is None else torch.tensor(hidden)
        leader(batch)
    # each step: its message, (the large one: its host metadata,) its device ints
    assert [(t.numel(), group) for t, _, group in wire.sent] == [
        (MESSAGE, "gloo group"), (3 * 2 + 1 + 1, "device group"),
        (MESSAGE, "gloo group"), (3 + 2 * 1500, "gloo group"), (3 * 1500 + 1, "device group"),
    ]  # fmt: skip
    assert all(src == 0 and t.dtype == torch.int64 for t, src, _ in wire.sent)
    leader.stop()
    monkeypatch.setattr(torch.distributed, "broadcast", wire.receive)
    followed: list[ForwardBatch] = []
    steps = follow_steps(TensorParallel(1, 2, "device group", "gloo group"), follower_pool,
                         None, "meta", followed.append)  # type: ignore[arg-type]  # fmt: skip
    assert steps == 2 and not wire.sent
    decode, prefill = followed
    assert decode.input_ids.device.type == "meta" and decode.input_ids.dtype == torch.int64
    assert decode.hidden_rows is not None and decode.hidden_rows.shape == (1,)
    assert [decode.logits_indices.numel(), prefill.logits_indices.numel()] == [1, 1]
    assert prefill.hidden_rows is None and prefill.positions.shape == (1500,)
    assert (prefill.seq_lens, prefill.extend_lens) == ([1500], [1500])
    assert torch.equal(follower_pool.table, leader_pool.table)


def test_the_step_executor_under_the_broadcaster_releases_its_capture() -> None:
    from radixserve.core.memory import ReqToTokenPool
    from radixserve.core.tp_step import StepBroadcaster, release_step

    inner = Executor()
    release_step(StepBroadcaster(TensorParallel(0, 2), ReqToTokenPool(2, 8), "cpu", inner))
    assert inner.released == 1
    release_step(inner)
    assert inner.released == 2
    release_step(lambda batch: batch)  # nothing to release
