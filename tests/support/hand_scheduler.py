"""A Scheduler on a small token pool, without a model: for the tests that drive its steps by
hand (schedule, then process_output with the tokens they choose)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.core.interfaces import StepStrategy
from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.core.radix_cache import RadixCache
from radixserve.core.scheduler import Scheduler, SchedulerConfig
from radixserve.core.stop import StopChecker
from radixserve.core.tokenizer import Tokenizer


def hand_scheduler(
    tokenizer: Tokenizer,
    eos: int,
    *,
    pool: int = 256,
    context: int = 64,
    running: int = 4,
    extra_rows: int = 0,
    strategies: Sequence[StepStrategy] = (),
    **config: Any,
) -> Scheduler:
    """FCFS, no chunking, page size 1; ``running + extra_rows + 1`` request rows of
    ``context + 1`` slots; ``config``: more SchedulerConfig fields."""
    allocator = TokenAllocator(pool, 1)
    table = ReqToTokenPool(running + extra_rows + 1, context + 1)
    return Scheduler(
        SchedulerConfig(
            max_running_requests=running,
            chunked_prefill_size=-1,
            max_context=context,
            schedule_policy="fcfs",
            **config,
        ),
        allocator,
        table,
        RadixCache(allocator, table),
        StopChecker(tokenizer, [eos], context),
        None,
        list(strategies),
    )
