"""Tensor parallelism's collectives (core/parallel.py) without processes: a platform's fast
all-reduce is tried first and the backend's takes what it declines; it is used on every rank
or on none; and leaving a group that does not close gives up after a limit, never hangs."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from radixserve.core import parallel
from radixserve.core.config import ConfigError
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
    return parallel._agreed_fast_all_reduce(platform, "group", 2, "cpu-group", True)


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
    assert parallel._agreed_fast_all_reduce(platform, "g", 2, "cpu", False) is None


def test_a_group_that_does_not_close_is_left_open_not_waited_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", release.wait)
    monkeypatch.setattr(parallel, "TEARDOWN_TIMEOUT_S", 0.2)
    fast = FakeFast(8)
    monkeypatch.setattr(parallel, "_current", TensorParallel(0, 2, fast_all_reduce=fast))
    monkeypatch.setattr(parallel, "_threads_before", torch.get_num_threads())
    try:
        parallel.teardown()  # returns after the limit
        assert parallel.current() is parallel.SINGLE and fast.closed
        with pytest.raises(ConfigError, match="did not close; start a tensor-parallel engine"):
            parallel.setup(Platform(None), 2, parallel.Rendezvous("file:///x", 0, 2))  # type: ignore[arg-type]
    finally:
        release.set()
        monkeypatch.setattr(parallel, "_stuck_group", False)
