"""order_waiting on its own, with a hand-built tree: the queue-length limits of prefix matching,
the single-request shortcut and the error for an unknown policy (the scheduler tests cover each
policy's order through a real engine)."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.core.radix_cache import TreeNode
from radixserve.core.request import Req, SamplingParams
from radixserve.core.schedule_policy import LPM_MAX_QUEUE, order_waiting, prefill_budget

ROOT = TreeNode([], torch.empty(0), None)


def reqs(n: int) -> list[Req]:
    return [Req(f"r{i}", [i], SamplingParams()) for i in range(n)]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_a_queue_at_the_limit_is_still_matched(policy: str) -> None:
    queue = reqs(LPM_MAX_QUEUE)
    child = TreeNode([1], torch.empty(0), ROOT)
    ROOT.children[1] = child
    try:
        last = queue[-1]
        order = order_waiting(
            policy,
            queue,
            lambda r: (10, child) if r is last else (0, ROOT),
            random.Random(0),
        )
    finally:
        ROOT.children.clear()
    if policy == "lpm":
        assert order[0] is last
    else:  # the root's own requests first, then the child's
        assert order[-1] is last
    assert sorted(r.rid for r in order) == sorted(r.rid for r in queue)


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_a_queue_past_the_limit_keeps_arrival_order_without_matching(policy: str) -> None:
    queue = reqs(LPM_MAX_QUEUE + 1)

    def match(r: Req) -> tuple[int, TreeNode]:
        raise AssertionError("no prefix matching past LPM_MAX_QUEUE")

    assert order_waiting(policy, queue, match, random.Random(0)) == queue


def test_a_single_request_is_not_matched() -> None:
    def match(r: Req) -> tuple[int, TreeNode]:
        raise AssertionError("a queue of one has nothing to order")

    queue = reqs(1)
    assert order_waiting("lpm", queue, match, random.Random(0)) == queue
    assert order_waiting("lpm", [], match, random.Random(0)) == []


def test_lpm_sorts_by_match_length_keeping_arrival_order_on_ties() -> None:
    queue = reqs(5)
    lengths = {"r0": 3, "r1": 7, "r2": 3, "r3": 0, "r4": 7}
    order = order_waiting("lpm", queue, lambda r: (lengths[r.rid], ROOT), random.Random(0))
    assert [r.rid for r in order] == ["r1", "r4", "r0", "r2", "r3"]


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown schedule policy 'sjf'"):
        order_waiting("sjf", reqs(2), lambda r: (0, ROOT), random.Random(0))


# -- the prefill budget beside a step's decodes ---------------------------------------------


@pytest.mark.parametrize(
    ("decodes", "budget"),
    [(0, 1024), (1, 1023), (8, 1016), (9, 910), (16, 512), (32, 256), (64, 128), (1020, 4)],
)
def test_prefill_shrinks_in_proportion_past_the_decode_count(decodes: int, budget: int) -> None:
    # a full chunk (less a token per decode) up to 8 decodes, then chunk * 8 / decodes, and
    # never more than the chunk leaves beside the decodes (1020 decodes: 4 tokens, not 8)
    assert prefill_budget(1024, decodes, shrink_after_decodes=8) == budget


@pytest.mark.parametrize("decodes", [0, 1, 32, 1023, 1024])
def test_without_shrinking_decodes_count_against_the_chunk(decodes: int) -> None:
    assert prefill_budget(1024, decodes) == prefill_budget(1024, decodes, 0) == 1024 - decodes


def test_no_chunking_means_no_limit_and_no_shrinking() -> None:
    assert prefill_budget(-1, 32, shrink_after_decodes=8) == (1 << 62) - 32
