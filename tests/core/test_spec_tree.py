"""Draft trees' shape, checks and acceptance (core/spec_tree.py), and what the core does with a
bad tree from a plugin."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.interfaces import Draft, SpeculativeAlgorithm
from radixserve.core.spec_tree import (
    accepted_nodes,
    ancestors,
    follow,
    node_depths,
    scratch_rows,
    tree_problem,
)
from radixserve.core.speculative import Speculator

#        root
#       /    \
#     7(0)   8(1)
#     /  \      \
#  9(2)  10(3)  11(4)
#   |
#  12(5)
TOKENS = [7, 8, 9, 10, 11, 12]
PARENTS = [-1, -1, 0, 0, 1, 2]


def test_depths_and_paths() -> None:
    assert node_depths(PARENTS) == [1, 1, 2, 2, 2, 3]
    assert ancestors(PARENTS, 5) == [0, 2, 5]
    assert ancestors(PARENTS, 4) == [1, 4]
    assert ancestors(PARENTS, 0) == [0]


def test_acceptance_walks_down_while_a_child_holds_the_sampled_token() -> None:
    # rows: root, then node j at 1 + j; the value is what the target samples after that row
    sampled = [7, 9, 0, 12, 0, 0, 5]
    assert accepted_nodes(TOKENS, PARENTS, sampled) == [0, 2, 5]
    # the second branch: 8, then 11; after 11 the target wants 3, which no child holds
    sampled = [8, 0, 11, 0, 0, 3, 0]
    assert accepted_nodes(TOKENS, PARENTS, sampled) == [1, 4]
    # no child of the root holds the sampled token: nothing is accepted
    assert accepted_nodes(TOKENS, PARENTS, [5, 7, 9, 12, 0, 0, 0]) == []


def test_follow_recovers_the_path_from_what_a_request_emitted() -> None:
    assert follow(TOKENS, PARENTS, [7, 9, 12, 5]) == [0, 2, 5]
    assert follow(TOKENS, PARENTS, [8, 11, 3]) == [1, 4]
    assert follow(TOKENS, PARENTS, [3]) == []


def test_trees_the_core_cannot_verify_are_named() -> None:
    assert tree_problem(TOKENS, PARENTS, 3, 6) is None
    assert "depth 3" in str(tree_problem(TOKENS, PARENTS, 2, 6))
    assert "7 nodes" not in str(tree_problem(TOKENS, PARENTS, 3, 5))
    assert "more than the 5" in str(tree_problem(TOKENS, PARENTS, 3, 5))
    assert "parent" in str(tree_problem([1, 2], [-1, 1], 3, 6))  # a child before its parent
    assert "parent" in str(tree_problem([1, 2], [-1, -2], 3, 6))
    assert "sibling" in str(tree_problem([1, 1], [-1, -1], 3, 6))
    assert "parents" in str(tree_problem([1, 2], [-1], 3, 6))
    assert tree_problem([], [], 0, 0) is None  # no draft: a tree of depth 0


def test_tokens_and_parents_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        accepted_nodes(TOKENS, PARENTS[:-1], [7, 9, 0, 12, 0, 0])
    with pytest.raises(ValueError):
        follow(TOKENS[:-1], PARENTS, [7, 9, 12, 5])


def test_scratch_rows_are_a_tree_batch_of_trees_and_their_drafting_rows() -> None:
    tree = EngineConfig(speculative_eagle_topk=4, speculative_num_steps=3)  # 12 nodes
    # 4 requests x 12 node rows for the verify, 4 x topk more for the drafter
    assert scratch_rows(tree) == (4 * 12 + 4 * 4, 4 * 12)
    assert scratch_rows(EngineConfig(speculative_num_draft_tokens=6)) == (0, 0)  # chains


class _Trees(SpeculativeAlgorithm):
    drafts_trees = True

    def __init__(self, draft: Draft) -> None:
        self.draft = draft

    def propose(self, reqs: Any, max_drafts: Any) -> list[Draft]:
        return [Draft([]) for _ in reqs]

    def propose_trees(self, reqs: Any, max_depths: Any, max_nodes: Any) -> list[Draft]:
        return [self.draft for _ in reqs]


def _speculator(draft: Draft) -> Speculator:
    return Speculator(_Trees(draft), "trees", 3, 8, 100, tree_nodes=6)


def test_a_bad_tree_from_a_plugin_becomes_no_draft() -> None:
    good = _speculator(Draft(TOKENS, None, None, PARENTS))
    (out,) = good.propose([object()], [3], [6])  # type: ignore[list-item]
    assert out.tokens == TOKENS and out.parents == PARENTS
    assert good.stats.trees == 1
    for bad in (
        Draft(TOKENS, None, None, [-1, -1, 0, 0, 1, 5]),  # node 5 its own parent
        Draft([7, 8, 9, 10, 11, 100], None, None, PARENTS),  # outside the vocabulary
        Draft(TOKENS, None, None, PARENTS[:-1]),
    ):
        sp = _speculator(bad)
        (out,) = sp.propose([object()], [3], [6])  # type: ignore[list-item]
        assert out.tokens == [] and out.parents is None
        assert sp.stats.trees == 0
    # deeper or larger than asked for
    (out,) = _speculator(Draft(TOKENS, None, None, PARENTS)).propose([object()], [2], [6])  # type: ignore[list-item]
    assert out.tokens == []


def test_trees_from_a_plugin_that_drafts_chains_are_refused_at_start() -> None:
    class Chains(_Trees):
        drafts_trees = False

    with pytest.raises(ConfigError, match="drafts chains only.*needs eagle or eagle3"):
        Speculator(Chains(Draft([])), "ngram", 3, 8, 100, tree_nodes=6)


def test_tree_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="needs --page-size 1"):
        EngineConfig(speculative_eagle_topk=2, page_size=16)
    with pytest.raises(ConfigError, match="simulates chains"):
        EngineConfig(speculative_eagle_topk=2, speculative_simulate_accept_len=2.0)
    tree = EngineConfig(speculative_eagle_topk=4, speculative_num_steps=3)
    assert (tree.draft_depth, tree.num_draft_tokens) == (3, 12)  # depth x topk nodes
    sized = EngineConfig(speculative_eagle_topk=4, speculative_num_draft_tokens=9)
    assert (sized.draft_depth, sized.num_draft_tokens) == (4, 8)
    chain = EngineConfig(speculative_num_draft_tokens=6)
    assert (chain.draft_depth, chain.num_draft_tokens) == (5, 5)
