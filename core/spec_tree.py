"""Draft trees (``--speculative-eagle-topk`` > 1): their shape, checks and acceptance.

A tree draft is a ``Draft`` whose ``parents`` give each token's parent: ``parents[j]`` is the
index of token j's parent in ``tokens``, or -1 where its parent is the root (the request's last
token, at position ``kv_len``). Tokens come in breadth-first order (a parent before its
children), siblings differ, and a node at depth d sits at position ``kv_len + d``.

The verify step runs the target once per node, as a decode row whose slot-table row is the
request's prefix followed by the node's ancestors and the node itself (a scratch row of the
slot table, ``TREE_BATCH`` requests' worth reserved at start): attention backends need no tree
mask, and the rows are plain decode rows to every backend and CUDA graph. Row 0 of an entry is
the root (the request's own row), row 1 + j node j. Acceptance walks down from the root while
a child holds the token the target samples at its parent; the accepted nodes' slots then take
positions ``kv_len + 1 ..`` of the request's row and the other nodes' slots are freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Requests of one step that may draft trees (the rest draft chains): each takes a tree's
#: worth of scratch slot-table rows for its verify, reserved at start.
TREE_BATCH = 4


def node_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (children of the root: 1)."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def ancestors(parents: Sequence[int], j: int) -> list[int]:
    """Node j's path from the root: its ancestors' indices by depth, then j."""
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]


def tree_problem(
    tokens: Sequence[int], parents: Sequence[int], max_depth: int, max_nodes: int
) -> str | None:
    """Why ``tokens``/``parents`` is not a tree the core can verify (None: it is one)."""
    if len(parents) != len(tokens):
        return f"{len(tokens)} tokens but {len(parents)} parents"
    if len(tokens) > max_nodes:
        return f"{len(tokens)} nodes, more than the {max_nodes} allowed"
    seen: set[tuple[int, int]] = set()
    for j, p in enumerate(parents):
        if not isinstance(p, int) or not -1 <= p < j:
            return f"node {j} has parent {p!r}: a parent comes before its child"
        if (p, tokens[j]) in seen:
            return f"node {j} repeats a sibling's token {tokens[j]}"
        seen.add((p, tokens[j]))
    depth = max(node_depths(parents), default=0)
    if depth > max_depth:
        return f"depth {depth}, more than the {max_depth} allowed"
    return None


def accepted_nodes(
    tokens: Sequence[int], parents: Sequence[int], sampled: Sequence[int]
) -> list[int]:
    """The nodes the target accepts, root to leaf: ``sampled[0]`` is the target's token after
    the root, ``sampled[1 + j]`` after node j; a child is accepted while its token is the one
    sampled at its parent."""
    children = _children(tokens, parents)
    path: list[int] = []
    node = -1
    while True:
        child = children.get((node, sampled[node + 1]))
        if child is None:
            return path
        path.append(child)
        node = child


def follow(tokens: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> list[int]:
    """The nodes whose tokens ``emitted`` holds, in order, from the root (``emitted`` as a
    verify step returns it: accepted tokens, then the target's own, which is no node)."""
    children = _children(tokens, parents)
    path: list[int] = []
    node = -1
    for token in emitted[:-1]:
        node = children[(node, token)]
        path.append(node)
    return path


def _children(tokens: Sequence[int], parents: Sequence[int]) -> dict[tuple[int, int], int]:
    """(parent, token) -> node."""
    return {(p, t): j for j, (p, t) in enumerate(zip(parents, tokens, strict=True))}


def scratch_rows(config: Any) -> tuple[int, int]:
    """Slot-table rows draft trees need beyond the requests' own: (all of them, the verify
    steps' node rows among them). The drafter's share is reserved at its setup."""
    node_rows = TREE_BATCH * config.tree_nodes
    return (node_rows + TREE_BATCH * config.speculative_eagle_topk if node_rows else 0), node_rows
