"""Waiting-queue orders (lpm: longest prefix match first, dfs-weight, fcfs, random) and how
many prefill tokens a step may take beside its decodes."""

from __future__ import annotations

import random
from collections.abc import Callable

from radixserve.core.radix_cache import TreeNode
from radixserve.core.request import Req

# Past this queue length, prefix matching every waiting request costs more than it saves.
LPM_MAX_QUEUE = 128


def order_waiting(
    policy: str,
    waiting: list[Req],
    match: Callable[[Req], tuple[int, TreeNode]],
    rng: random.Random,
) -> list[Req]:
    """Return ``waiting`` in the order admission should try it (ties keep arrival order)."""
    if policy == "fcfs" or len(waiting) <= 1:
        return list(waiting)
    if policy == "random":
        shuffled = list(waiting)
        rng.shuffle(shuffled)
        return shuffled
    if len(waiting) > LPM_MAX_QUEUE:
        return list(waiting)
    matches = {id(r): match(r) for r in waiting}
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -matches[id(r)][0])
    if policy == "dfs-weight":
        return _dfs_weight_order(waiting, {id(r): matches[id(r)][1] for r in waiting})
    raise ValueError(f"unknown schedule policy '{policy}'")


def prefill_budget(chunk_size: int, num_decodes: int, shrink_after_decodes: int = 0) -> int:
    """Prefill tokens a step may compute beside ``num_decodes`` decodes.

    A step computes at most ``chunk_size`` tokens, its decodes one each (-1: no limit). With
    ``shrink_after_decodes`` > 0 and more decodes than that in the step, its prefill part
    shrinks in proportion, to ``chunk_size * shrink_after_decodes / num_decodes`` tokens:
    every decode of a step waits for the step's prefill, so the more decodes share a step, the
    smaller the chunk they should wait for (the inter-token latency tail), while a step with
    few or no decodes still takes a full chunk (requests reach decoding as fast as before)."""
    if chunk_size <= 0:
        return (1 << 62) - num_decodes
    budget = chunk_size - num_decodes
    if 0 < shrink_after_decodes < num_decodes:
        budget = min(budget, chunk_size * shrink_after_decodes // num_decodes)
    return budget


def _dfs_weight_order(waiting: list[Req], nodes: dict[int, TreeNode]) -> list[Req]:
    """Visit the tree depth-first, heaviest subtree (most waiting requests) first, so requests
    sharing a prefix run back to back; equal weights go in order of their earliest arrival."""
    attached: dict[int, list[Req]] = {}
    weight: dict[int, int] = {}
    first: dict[int, int] = {}  # arrival index of the earliest waiting request below the node
    node_of: dict[int, TreeNode] = {}
    for i, req in enumerate(waiting):
        node: TreeNode | None = nodes[id(req)]
        attached.setdefault(id(node), []).append(req)
        while node is not None:
            weight[id(node)] = weight.get(id(node), 0) + 1
            first.setdefault(id(node), i)
            node_of[id(node)] = node
            node = node.parent

    def stacked(ns: list[TreeNode]) -> list[TreeNode]:  # the stack pops the last one first
        return sorted(ns, key=lambda n: (weight[id(n)], -first[id(n)]))

    ordered: list[Req] = []
    stack = stacked([n for n in node_of.values() if n.parent is None])
    while stack:
        node = stack.pop()
        ordered.extend(attached.get(id(node), []))
        stack.extend(stacked([c for c in node.children.values() if id(c) in weight]))
    return ordered
