"""Helpers shared by the scheduler tests: prompts of the tiny model, greedy params, and the
KV accounting check run between steps."""

from __future__ import annotations

import random

from radixserve.core.engine_core import EngineCore
from radixserve.core.request import SamplingParams

# Token ids of the tiny model (vocab 362); 0..2 are special tokens.
LOW, HIGH = 3, 360


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(LOW, HIGH) for _ in range(n)]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def check_accounting(core: EngineCore) -> None:
    """Between steps every slot is free, in the tree, or computed-but-uncached by a running
    request (its tokens past its cached prefix, up to the end of its last page)."""
    sched = core.scheduler
    acct = sched.kv_accounting()
    p = sched.allocator.page_size
    held = sum(-(-r.kv_len // p) * p - r.prefix_len for r in sched.running)
    assert acct["in_use"] == held, (acct, sched.running)
    assert acct["free"] + acct["evictable"] + acct["locked"] + held == acct["size"]
    if not sched.running:
        sched.check_no_leak()
        assert acct["locked"] == 0


def run_to_idle(core: EngineCore) -> None:
    """Step ``core`` until it has no work, checking the accounting between steps."""
    for _ in range(5000):
        if not core.has_work():
            return
        core.step()
        check_accounting(core)
    raise AssertionError("no progress")
