"""Draft trees from an EAGLE head (``--speculative-eagle-topk`` W > 1), EAGLE-2's dynamic tree.

The head's catch-up row (as in a chain proposal) gives the root's W likeliest children. Each
level then expands its W likeliest nodes (by cumulative log-probability) into W children each,
in one head forward for the level, down to the depth asked for; the tree keeps the N likeliest
of all the nodes met (an ancestor is never less likely than its descendant, so the kept set is
a tree), breadth-first, for the target to verify as decode rows (core/spec_tree.py).

Draft KV of the expanded nodes: a node's head row reads its token with its parent's head
output, at the position after its parent, and attends to the request's draft KV up to
position kv_len - 1 and to its ancestors' rows. Those rows live in scratch slots of the head's
own KV pool (past the target's slots) through scratch rows of the slot table; no row of a
request changes, and nothing a tree wrote is trusted later (the next proposal catches up from
the target's features, as after a chain).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixserve.core.batch import to_device
from radixserve.core.interfaces import Draft
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.request import Req
from radixserve.plugins.speculative.head_layer import DraftHead


class TreeHead(Protocol):
    """What a tree needs of its drafter (``head_draft.HeadDraft``, which imports this module)."""

    head: DraftHead
    device: str

    def head_hidden(
        self,
        reqs: Sequence[Any],
        batch: list[tuple[int, int, int]],
        input_ids: torch.Tensor,
        feature: torch.Tensor,
    ) -> torch.Tensor:
        """The head's output at the last row of each ``batch`` entry."""
        ...


@dataclass(slots=True)
class _Node:
    score: float  # cumulative log-probability under the head
    parent: int  # index of the parent node in the request's list, -1 for the root
    token: int  # target token id
    depth: int
    slot: int = 0  # the head's scratch slot of its row, once expanded
    hidden: int = -1  # its head output's row in the level's forward, once expanded


class _Row:
    """A stand-in request for ``draft_batch``: only its slot-table row is read."""

    __slots__ = ("req_pool_idx",)

    def __init__(self, row: int) -> None:
        self.req_pool_idx = row


class TreeDrafter:
    def __init__(
        self,
        drafter: TreeHead,
        topk: int,
        req_to_token: ReqToTokenPool,
        rows: list[int],
        first_slot: int,
        max_requests: int,
        max_depth: int,
    ) -> None:
        """``rows``: ``max_requests * topk`` scratch rows of the slot table; the head's pool
        has ``max_requests * topk * max_depth`` scratch slots from ``first_slot`` on."""
        self.drafter = drafter
        self.topk = topk
        self.req_to_token = req_to_token
        self.rows = rows
        self.first_slot = first_slot
        self.max_requests = max_requests
        self.max_depth = max_depth

    def draft(
        self,
        reqs: Sequence[Req],
        spans: list[tuple[int, int, int]],
        hidden: torch.Tensor,
        depths: Sequence[int],
        max_nodes: Sequence[int],
    ) -> list[Draft]:
        """Each request's tree from its catch-up (``spans`` and the head's ``hidden`` output
        at their last rows, HeadDraft._catch_up), at most ``depths[i]`` deep and
        ``max_nodes[i]`` large."""
        assert len(reqs) <= self.max_requests
        nodes: list[list[_Node]] = [[] for _ in reqs]
        root_rows = {i: row for row, (i, _, _) in enumerate(spans)}  # catch-up output rows
        self._add_root_children(nodes, root_rows, hidden)
        for depth in range(1, max(depths)):
            level = {i: self._frontier(nodes[i], depth) for i in range(len(reqs))}
            level = {i: f for i, f in level.items() if f and depth < depths[i]}
            if not level:
                break
            hidden = self._expand(reqs, nodes, level, hidden, root_rows, depth)
            self._add_level_children(nodes, [(i, j) for i, f in level.items() for j in f], hidden)
        return [self._tree(n, m) for n, m in zip(nodes, max_nodes, strict=True)]

    def _frontier(self, nodes: list[_Node], depth: int) -> list[int]:
        """The ``topk`` likeliest nodes of ``depth``, to expand."""
        at = [j for j, n in enumerate(nodes) if n.depth == depth]
        at.sort(key=lambda j: -nodes[j].score)
        return at[: self.topk]

    def _children(self, hidden: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """The ``topk`` likeliest next tokens after each head output row: (log-probabilities,
        target token ids), read to the host."""
        head = self.drafter.head
        logp = torch.log_softmax(head.draft_logits(hidden), dim=-1)
        values, ids = logp.topk(self.topk, dim=-1)
        # one device-to-host copy (ids are exact in float64: vocabularies are < 2**53)
        both = torch.stack([values.double(), head.to_target(ids).double()]).tolist()
        return both[0], [[int(t) for t in row] for row in both[1]]

    def _add_root_children(
        self, nodes: list[list[_Node]], rows: dict[int, int], hidden: torch.Tensor
    ) -> None:
        """The root's children: request i's catch-up output is row ``rows[i]`` of ``hidden``."""
        values, ids = self._children(hidden)
        for i, row in rows.items():
            for lp, token in zip(values[row], ids[row], strict=True):
                nodes[i].append(_Node(lp, -1, token, 1))

    def _add_level_children(
        self, nodes: list[list[_Node]], expanded: list[tuple[int, int]], hidden: torch.Tensor
    ) -> None:
        """Children of the ``expanded`` (request, node) pairs, row k of ``hidden`` each."""
        values, ids = self._children(hidden)
        for k, (i, j) in enumerate(expanded):
            parent = nodes[i][j]
            parent.hidden = k
            for lp, token in zip(values[k], ids[k], strict=True):
                nodes[i].append(_Node(parent.score + lp, j, token, parent.depth + 1))

    def _expand(
        self,
        reqs: Sequence[Req],
        nodes: list[list[_Node]],
        level: dict[int, list[int]],
        parent_hidden: torch.Tensor,
        root_rows: dict[int, int],
        depth: int,
    ) -> torch.Tensor:
        """One head forward over the level's chosen nodes (each on a scratch row: the
        request's rows up to kv_len - 1, then its ancestors' scratch slots); their outputs."""
        d = self.drafter
        table = self.req_to_token.table
        stand_ins: list[_Row] = []
        spans: list[tuple[int, int, int]] = []
        tokens: list[int] = []
        feature_rows: list[int] = []
        for i, chosen in level.items():
            req = reqs[i]
            assert req.req_pool_idx is not None
            prefix = table[req.req_pool_idx, : req.kv_len]
            for f, j in enumerate(chosen):
                node = nodes[i][j]
                node.slot = self.first_slot + (i * self.topk + f) * self.max_depth + depth - 1
                path = []
                a = j
                while a >= 0:
                    path.append(nodes[i][a].slot)
                    a = nodes[i][a].parent
                row = self.rows[i * self.topk + f]
                self.req_to_token.write(row, 0, torch.cat([prefix, torch.tensor(path[::-1])]))
                spans.append((len(stand_ins), req.kv_len - 1 + depth, 1))
                stand_ins.append(_Row(row))
                tokens.append(node.token)
                # the root's children read the catch-up output; deeper nodes their parent's
                parent = node.parent
                feature_rows.append(root_rows[i] if parent < 0 else nodes[i][parent].hidden)
        input_ids = to_device(torch.tensor(tokens), d.device)
        feature = parent_hidden[to_device(torch.tensor(feature_rows), d.device)]
        return d.head_hidden(stand_ins, spans, input_ids, feature)

    def _tree(self, nodes: list[_Node], max_nodes: int) -> Draft:
        """The ``max_nodes`` likeliest nodes, breadth-first, as a tree draft."""
        ranked = sorted(range(len(nodes)), key=lambda j: (-nodes[j].score, nodes[j].depth))
        kept: list[int] = []
        taken: set[int] = set()
        for j in ranked:
            if len(kept) == max_nodes:
                break
            if nodes[j].parent < 0 or nodes[j].parent in taken:
                kept.append(j)
                taken.add(j)
        kept.sort(key=lambda j: (nodes[j].depth, -nodes[j].score))
        index = {j: k for k, j in enumerate(kept)}
        parents = [index[nodes[j].parent] if nodes[j].parent >= 0 else -1 for j in kept]
        return Draft([nodes[j].token for j in kept], None, None, parents)
