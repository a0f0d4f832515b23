"""The cpu platform's share of the host: the server's engine process takes every core unless
--cpu-threads says otherwise; tensor-parallel ranks keep their own share."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from radixserve.plugins.hardware.cpu import CpuPlatform


@pytest.fixture(autouse=True)
def _threads_restored() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_server_engine_takes_every_core() -> None:
    torch.set_num_threads(len(os.sched_getaffinity(0)) + 3)
    CpuPlatform().bind_server_engine()
    assert torch.get_num_threads() == len(os.sched_getaffinity(0))


def test_tensor_parallel_rank_keeps_its_share() -> None:
    platform = CpuPlatform()
    platform.bind_rank(0, 2)
    share = torch.get_num_threads()
    platform.bind_server_engine()
    assert torch.get_num_threads() == share == max(1, len(os.sched_getaffinity(0)) // 2)


def test_cpu_threads_is_kept_in_the_server_engine() -> None:
    from radixserve.core.config import EngineConfig

    platform = CpuPlatform()
    platform.step_executor(None, None, None, None, EngineConfig(cpu_threads=3))
    assert torch.get_num_threads() == 3
    platform.bind_server_engine()
    assert torch.get_num_threads() == 3  # not every core
