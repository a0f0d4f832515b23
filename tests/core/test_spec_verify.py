"""Verifying drafts against the target's logits (core/spec_verify.py), engine-free: hand-made
logits rows, real requests and the real sampler; what each request emits, with which logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.core.interfaces import Draft
from radixserve.core.request import Req, SamplingParams
from radixserve.core.spec_verify import (
    DraftPosition,
    plain_greedy,
    read_pending,
    verify,
    verify_drafts,
)

V = 16
EOS = 15
NEG = float("-inf")


class Exact:
    """A speculator that does not simulate accept lengths."""

    simulate_accept_len = None

    def simulated(self, num_drafted: int, rid: str = "") -> int:
        raise AssertionError("not simulated")


class Simulated:
    """Accepts ``count`` drafts of every request, whatever the target says."""

    def __init__(self, count: int) -> None:
        self.simulate_accept_len = float(count)
        self.count = count
        self.asked: list[tuple[int, str]] = []

    def simulated(self, num_drafted: int, rid: str = "") -> int:
        self.asked.append((num_drafted, rid))
        return self.count


class Banning:
    """A grammar masker that bans one token at every row of a constrained request."""

    def __init__(self, banned: int) -> None:
        self.banned = banned
        self.chains: list[tuple[int, Any, list[int]]] = []

    def apply_chains(self, logits: torch.Tensor, chains: Sequence[tuple[int, Any, Any]]) -> None:
        for first, grammar, draft in chains:
            self.chains.append((first, grammar, list(draft)))
            if grammar is not None:
                logits[first : first + len(draft) + 1, self.banned] = NEG


def _req(rid: str = "r", outputs: Sequence[int] = (), **sampling: Any) -> Req:
    sampling.setdefault("temperature", 0.0)
    req = Req(rid, [1, 2, 3], SamplingParams(**sampling))
    req.output_ids = list(outputs)
    return req


def _rows(*rows: dict[int, float], rest: float = -4.0) -> torch.Tensor:
    """Logits rows: the given tokens' logits, ``rest`` elsewhere."""
    logits = torch.full((len(rows), V), rest)
    for i, row in enumerate(rows):
        for token, value in row.items():
            logits[i, token] = value
    return logits


def _top(*tokens: int) -> torch.Tensor:
    """Rows whose argmax is each of ``tokens``."""
    return _rows(*({t: 2.0} for t in tokens))


def _ids(emitted: list[list[Any]]) -> list[list[int]]:
    return [[t for t, _, _ in e] for e in emitted]


def _verify(logits: torch.Tensor, reqs: list[Req], drafts: list[list[int]], **kw: Any) -> Any:
    probs = kw.pop("probs", [None] * len(reqs))
    return verify(
        logits, reqs, drafts, probs, [EOS], kw.pop("masker", None), kw.pop("spec", Exact()), **kw
    )


# -- chains ------------------------------------------------------------------------------------


def test_a_chain_emits_its_accepted_prefix_and_the_targets_next_token() -> None:
    reqs = [_req("a"), _req("b"), _req("c")]
    drafts = [[5, 6, 7], [8, 9], []]
    # a: rows want 5, 6, 2 (7 rejected), 4; b: wants 3 at once; c: no draft, one row
    logits = _top(5, 6, 2, 4, 3, 9, 1, 11)
    expected = [[5, 6, 2], [3], [11]]
    assert _ids(_verify(logits.clone(), reqs, drafts)) == expected
    assert all(t[1:] == (None, None) for e in _verify(logits.clone(), reqs, drafts) for t in e)
    # the same with the argmax already read (every request plain greedy)
    greedy = logits.argmax(dim=-1).tolist()
    assert _ids(_verify(logits.clone(), reqs, drafts, greedy_ids=greedy)) == expected
    # a fully accepted chain emits every draft and the token after the last
    assert _ids(_verify(_top(5, 6, 7, 8), [_req()], [[5, 6, 7]])) == [[5, 6, 7, 8]]


def test_verify_drafts_reads_pending_drafts_and_the_argmax_in_one_go() -> None:
    a, b = _req("a"), _req("b")
    pending = Draft([0, 0], pending=torch.tensor([5, 6], dtype=torch.int32))
    logits = _top(5, 6, 12, 9)
    emitted = verify_drafts(logits, [a, b], [pending, None], [EOS], None, Exact())
    assert pending.tokens == [5, 6] and pending.pending is None
    assert _ids(emitted) == [[5, 6, 12], [9]]


def test_verify_drafts_masks_constrained_rows_and_rejection_samples_drafts_with_probs() -> None:
    constrained = _req("c")
    constrained.grammar = object()
    masker = Banning(5)
    # p = 1/2 on 3 and on 4, q(4) = 0.01: a sampled draft of 4 is always accepted
    sampled = [_req("s", temperature=1.0, seed=s) for s in range(12)]
    rows = [{5: 3.0, 6: 2.0}, {1: 2.0}] + [{3: 0.0, 4: 0.0}, {2: 9.0}] * 12
    q = torch.full((1, V), 0.99 / (V - 1))
    q[0, 4] = 0.01
    drafts = [Draft([6])] + [Draft([4], probs=q) for _ in sampled]
    emitted = verify_drafts(
        _rows(*rows, rest=NEG), [constrained, *sampled], drafts, [EOS], masker, Exact()
    )
    assert _ids(emitted) == [[6, 1]] + [[4, 2]] * 12
    assert masker.chains[0] == (0, constrained.grammar, [6])


def test_verify_drafts_samples_where_a_request_is_not_plain_greedy() -> None:
    """min_new_tokens masks EOS at rows before it, which a bare argmax would not."""
    req = _req(min_new_tokens=2)
    # every row's best token is EOS; the second best 4, 5, then 6
    logits = _rows({EOS: 3.0, 4: 2.0}, {EOS: 3.0, 5: 2.0}, {EOS: 3.0, 6: 2.0})
    emitted = verify_drafts(logits, [req], [Draft([4, 5])], [EOS], None, Exact())
    assert _ids(emitted) == [[4, 5, EOS]]  # EOS allowed from the third token on
    # a request one token short of its minimum: only the first row masks EOS
    short = _req(outputs=[1], min_new_tokens=2)
    logits = _rows({EOS: 3.0, 4: 2.0}, {EOS: 3.0, 5: 2.0}, {EOS: 3.0, 6: 2.0})
    emitted = verify_drafts(logits, [short], [Draft([4, 5])], [EOS], None, Exact())
    assert _ids(emitted) == [[4, EOS]]


def test_each_row_sees_the_draft_tokens_before_it() -> None:
    """A presence penalty at row j counts the first j draft tokens as outputs."""
    req = _req(outputs=[9], presence_penalty=2.0)
    # row 0: 5 (3.0) over 7 (2.5); row 1: 5 again, now penalized (5 was drafted): 7 wins;
    # row 2: 9 penalized from the request's own outputs, 8 wins
    logits = _rows({5: 3.0, 7: 2.5}, {5: 3.0, 7: 2.5}, {9: 3.0, 8: 2.5})
    assert _ids(_verify(logits, [req], [[5, 7]])) == [[5, 7, 8]]
    logits = _rows({5: 3.0, 7: 2.5}, {5: 3.0, 7: 2.5}, {9: 3.0, 8: 2.5})
    assert _ids(_verify(logits, [req], [[5, 5]])) == [[5, 7]]


def test_a_draft_position_is_its_request_with_the_draft_so_far() -> None:
    req = _req(outputs=[4, 4], temperature=0.5)
    req.grammar = object()
    view = DraftPosition(req, [7, 8, 9], 2)
    assert view.output_ids == [4, 4, 7, 8] and view.num_output_tokens == 4
    assert DraftPosition(req, [7], 0).output_ids == [4, 4]
    assert view.sampling is req.sampling and view.input_ids == [1, 2, 3]
    assert view.grammar is req.grammar
    view.bias_entries = ([1], [0.5])
    assert req.bias_entries == ([1], [0.5]) and view.bias_entries == ([1], [0.5])
    view.failed = "bad row"
    assert req.failed == "bad row" and view.failed == "bad row"


# -- trees -------------------------------------------------------------------------------------

#        root
#       /    \
#     7(0)   8(1)
#     /  \      \
#  9(2)  10(3)  11(4)
TOKENS = [7, 8, 9, 10, 11]
PARENTS = [-1, -1, 0, 0, 1]


def test_a_tree_emits_its_accepted_path_and_the_targets_token_after_it() -> None:
    # rows: root, then node j at 1 + j; root wants 8, node 1 (8) wants 11, node 4 (11) wants 3
    logits = _top(8, 0, 11, 0, 0, 3)
    out = _verify(logits, [_req()], [TOKENS], trees=[PARENTS])
    assert _ids(out) == [[8, 11, 3]]
    # through verify_drafts, the parents taken from the draft; the second request a chain
    logits = _top(7, 10, 0, 0, 12, 0, 5, 6)
    drafts = [Draft(list(TOKENS), parents=list(PARENTS)), Draft([5])]
    out = verify_drafts(logits, [_req("t"), _req("c")], drafts, [EOS], None, Exact())
    assert _ids(out) == [[7, 10, 12], [5, 6]]


def test_a_tree_row_sees_its_own_path_only() -> None:
    """min_new_tokens=2: EOS is masked at the root and at depth 1, allowed at depth 2; node 3
    (10, depth 2) sees the path 7, 10, not the tokens drafted before it."""
    req = _req(min_new_tokens=2)
    rows = [{EOS: 3.0, 7: 2.0}, {EOS: 3.0, 10: 2.0}, {}, {}, {EOS: 3.0, 1: 2.0}, {}]
    out = _verify(_rows(*rows), [req], [TOKENS], trees=[PARENTS])
    assert _ids(out) == [[7, 10, EOS]]
    # min_new_tokens=1: masked at the root only
    rows = [{EOS: 3.0, 7: 2.0}, {EOS: 3.0, 10: 2.0}, {}, {}, {}, {}]
    out = _verify(_rows(*rows), [_req(min_new_tokens=1)], [TOKENS], trees=[PARENTS])
    assert _ids(out) == [[7, EOS]]
    # a presence penalty at node 3 (10) counts 7 and 10, not 8 (drafted, on another branch)
    rows = [{7: 3.0}, {7: 3.0, 10: 2.5}, {}, {}, {10: 3.0, 7: 2.95, 8: 2.9}, {}]
    out = _verify(_rows(*rows), [_req(presence_penalty=2.0)], [TOKENS], trees=[PARENTS])
    assert _ids(out) == [[7, 10, 8]]


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_the_targets_at_each_emitted_row() -> None:
    reqs = [_req("a", logprobs=True, top_logprobs_num=2), _req("b", logprobs=True)]
    logits = _rows({5: 2.0, 6: 1.0}, {6: 3.0, 1: 2.5}, {4: 1.0}, {9: 2.0})
    expected = torch.log_softmax(logits, dim=-1)
    out = _verify(logits.clone(), reqs, [[5, 7], []])
    assert _ids(out) == [[5, 6], [9]]
    (a5, a6), (b9,) = out
    assert math.isclose(a5[1], float(expected[0, 5]), rel_tol=1e-5)
    assert math.isclose(a6[1], float(expected[1, 6]), rel_tol=1e-5)
    assert [t for _, t in a6[2]] == [6, 1]
    assert math.isclose(b9[1], float(expected[3, 9]), rel_tol=1e-5) and b9[2] == []


def test_a_constrained_requests_logprobs_are_the_models_not_the_masks() -> None:
    req = _req(logprobs=True)
    req.grammar = object()
    other = _req("free")
    masker = Banning(5)
    logits = _rows({5: 3.0}, {5: 3.0, 6: 2.0}, {8: 1.0})
    raw = torch.log_softmax(logits, dim=-1)
    out = _verify(logits, [other, req], [[], [6]], masker=masker)
    assert _ids(out) == [[5], [6, 8]]  # 5 banned for the constrained request only
    assert masker.chains == [(0, None, []), (1, req.grammar, [6])]
    assert math.isclose(out[1][0][1], float(raw[1, 6]), rel_tol=1e-5)
    # without logprobs the masked logits are all there is
    plain = _req()
    plain.grammar = object()
    out = _verify(_rows({5: 3.0, 6: 2.0}), [plain], [[]], masker=Banning(5))
    assert _ids(out) == [[6]]


# -- simulated accept lengths ------------------------------------------------------------------


def test_a_simulated_accept_length_emits_that_many_drafts() -> None:
    spec = Simulated(2)
    reqs = [_req("a", logprobs=True), _req("b")]
    logits = _top(9, 9, 9, 9, 4)
    expected = torch.log_softmax(logits, dim=-1)
    out = _verify(logits.clone(), reqs, [[5, 6, 7], []], spec=spec)
    assert _ids(out) == [[5, 6, 9], [4]]
    assert spec.asked == [(3, "a")]  # a request without a draft is not simulated
    # the drafts written in are scored again
    assert math.isclose(out[0][0][1], float(expected[0, 5]), rel_tol=1e-5)
    assert math.isclose(out[0][2][1], float(expected[2, 9]), rel_tol=1e-5)
    # a constrained request's drafts, scored again, are scored by the model, not the mask
    req = _req(logprobs=True)
    req.grammar = object()
    logits = _rows({5: 3.0, 6: 2.0}, {8: 1.0})
    raw = torch.log_softmax(logits, dim=-1)
    out = _verify(logits, [req], [[6]], spec=Simulated(1), masker=Banning(5))
    assert _ids(out) == [[6, 8]] and math.isclose(out[0][0][1], float(raw[0, 6]), rel_tol=1e-5)


# -- rejection sampling ------------------------------------------------------------------------


def _one_hot(*tokens: int) -> torch.Tensor:
    q = torch.zeros(len(tokens), V)
    for j, t in enumerate(tokens):
        q[j, t] = 1.0
    return q


def test_drafts_drawn_from_the_target_are_all_accepted() -> None:
    """q == p: every draft is accepted (min(1, p/q) = 1), also where q comes unnormalized and
    p is cut by top-k (neither is a distribution as given)."""
    torch.manual_seed(0)
    for seed in range(6):
        logits = torch.randn(9, V)
        req = _req(temperature=1.0, top_k=6, seed=seed)
        draft = [int(t) for t in logits[:8].topk(6).indices[:, seed % 6]]
        q = torch.softmax(logits[:8], dim=-1)
        kept = q >= q.topk(6, dim=-1).values[:, -1:]
        q = torch.where(kept, q, 0.0) * 3.0
        out = _verify(logits, [req], [draft], probs=[q])
        assert _ids(out)[0][:8] == draft and len(out[0]) == 9, seed


def test_a_rejected_draft_is_replaced_by_a_draw_from_the_residual() -> None:
    req = _req(temperature=1.0, seed=1)
    # p = 1/2 on 3 and on 4; q = 1/2 on 4 and on 5; draft 5: p(5) = 0, always rejected;
    # residual max(p - q, 0) = 1/2 on 3 only
    logits = _rows({3: 0.0, 4: 0.0}, {1: 2.0}, rest=NEG)
    q = torch.zeros(1, V)
    q[0, 4] = q[0, 5] = 0.5
    for seed in range(5):
        req = _req(temperature=1.0, seed=seed)
        assert _ids(_verify(logits.clone(), [req], [[5]], probs=[q])) == [[3]]
    # q == p and a draft token neither gives: the residual is empty, the draw is from p
    only = _rows({3: 0.0}, {1: 2.0}, rest=NEG)
    out = _verify(only, [_req(temperature=1.0, seed=2)], [[5]], probs=[_one_hot(3)])
    assert _ids(out) == [[3]]


def test_acceptance_is_random_with_probability_p_over_q() -> None:
    """p = 1/2 on 4 and on 3, q puts 0.99 on 4: accepted about half of the time, where exact
    matching would accept only what the target samples, and rejection of a sure token never."""
    torch.manual_seed(0)
    logits = _rows({3: 0.0, 4: 0.0}, {6: 2.0}, rest=NEG)
    q = torch.zeros(1, V)
    q[0, 4], q[0, 5] = 0.99, 0.01
    outs = [
        tuple(_ids(_verify(logits.clone(), [_req(temperature=1.0, seed=s)], [[4]], probs=[q]))[0])
        for s in range(40)
    ]
    assert set(outs) == {(4, 6), (3,)}
    # seeds that differ only above their low 16 bits draw independently too
    high = {
        _ids(_verify(logits.clone(), [_req(temperature=1.0, seed=s << 16)], [[4]], probs=[q]))[0][0]
        for s in range(1, 30)
    }
    assert high == {3, 4}
    # the same seeds draw the same, whatever the global generator does
    torch.manual_seed(1)
    again = [
        tuple(_ids(_verify(logits.clone(), [_req(temperature=1.0, seed=s)], [[4]], probs=[q]))[0])
        for s in range(40)
    ]
    assert again == outs
    # unseeded requests draw from the global generator
    assert _ids(_verify(logits.clone(), [_req(temperature=1.0)], [[4]], probs=[q]))[0][0] in (3, 4)


def test_rejection_sampling_is_only_for_sampled_unconstrained_drafts() -> None:
    """A draft with probabilities from a greedy or a constrained request is matched exactly:
    accepted only where it is what the target samples."""
    logits = _rows({3: 1.0, 4: 0.0}, {6: 2.0}, rest=NEG)
    q = _one_hot(4) * 0.001 + torch.full((1, V), 0.999 / V)
    # the greedy target wants 3
    assert _ids(_verify(logits.clone(), [_req()], [[4]], probs=[q])) == [[3]]
    outs = set()
    for s in range(30):
        constrained = _req(temperature=1.0, seed=s)
        constrained.grammar = object()
        out = _verify(logits.clone(), [constrained], [[4]], probs=[q], masker=Banning(9))
        outs.add(tuple(_ids(out)[0][:1]))
    # the target's own samples (p(3) = 0.73); rejection sampling would accept 4 every time
    # (p(4) = 0.27 over q(4) = 0.06)
    assert outs == {(3,), (4,)}


def test_the_rows_of_a_rejection_sampled_request_are_its_own() -> None:
    """Two requests in one verify: the second's rows start after the first's."""
    first = _req("g")
    second = _req("s", temperature=1.0, seed=3)
    logits = _rows({2: 2.0}, {8: 2.0}, {3: 0.0}, {6: 2.0}, rest=NEG)
    out = _verify(logits, [first, second], [[2], [3]], probs=[None, _one_hot(3)])
    assert _ids(out) == [[2, 8], [3, 6]]


# -- helpers -----------------------------------------------------------------------------------


def test_plain_greedy_is_a_bare_argmax_only() -> None:
    assert plain_greedy(_req())
    assert plain_greedy(_req(outputs=[1, 2], min_new_tokens=2))
    assert plain_greedy(_req(temperature=1.0, top_k=1))
    for kw in (
        {"temperature": 1.0},
        {"logprobs": True},
        {"frequency_penalty": 0.5},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.1},
        {"logit_bias": {"3": 1.0}},
        {"min_new_tokens": 1},
    ):
        assert not plain_greedy(_req(**kw)), kw
    constrained = _req()
    constrained.grammar = object()
    assert not plain_greedy(constrained)


def test_read_pending_reads_every_pending_draft_with_the_extra_values() -> None:
    a = Draft([0, 0], pending=torch.tensor([[5], [6]]))
    b = Draft([0, 0, 0], pending=torch.tensor([7, 8, 9], dtype=torch.int32))
    done = Draft([1, 2])
    also = torch.tensor([[4, 2]])
    assert read_pending([a, None, done, b], also) == [4, 2]
    assert (a.tokens, b.tokens, done.tokens) == ([5, 6], [7, 8, 9], [1, 2])
    assert a.pending is None and b.pending is None
    c = Draft([0], pending=torch.tensor([3]))
    assert read_pending([c]) == [] and c.tokens == [3]
    assert read_pending([None, done]) == []
    assert read_pending([], torch.tensor([1])) == [1]


def test_each_draft_row_is_judged_by_its_own_distributions() -> None:
    """Row 0: p and q both sure of 4 (accepted). Row 1: p = 1/2 on 3 and on 6, q = 1/2 on 6 and
    on 5, draft 5 (p(5) = 0): rejected, the residual is 3 alone; the target itself would
    sample 6 half of the time."""
    logits = _rows({4: 0.0}, {3: 0.0, 6: 0.0}, {2: 0.0}, rest=NEG)
    q = torch.zeros(2, V)
    q[0, 4] = 1.0
    q[1, 5] = q[1, 6] = 0.5
    for seed in range(12):
        out = _verify(logits.clone(), [_req(temperature=1.0, seed=seed)], [[4, 5]], probs=[q])
        assert _ids(out) == [[4, 3]], seed


def test_q_is_normalized_per_row() -> None:
    """Two rows, each q sure of 4 where p gives it 1/2: the first is accepted only about half of
    the time (q's rows are each a distribution, not halves of one)."""
    logits = _rows({3: 0.0, 4: 0.0}, {3: 0.0, 4: 0.0}, {2: 0.0}, rest=NEG)
    firsts = {
        _ids(
            _verify(
                logits.clone(), [_req(temperature=1.0, seed=s)], [[4, 4]], probs=[_one_hot(4, 4)]
            )
        )[0][0]
        for s in range(30)
    }
    assert firsts == {3, 4}


def test_a_seeded_residual_draw_is_reproducible() -> None:
    """p = 1/2 on 3 and on 6, draft 5 (q sure of it): always rejected, the residual is p."""
    torch.manual_seed(0)
    logits = _rows({3: 0.0, 6: 0.0}, {2: 0.0}, rest=NEG)
    draws = []
    for seed in range(20):
        pair = [
            _ids(
                _verify(
                    logits.clone(), [_req(temperature=1.0, seed=seed)], [[5]], probs=[_one_hot(5)]
                )
            )[0]
            for _ in range(2)
        ]
        assert pair[0] == pair[1], seed
        draws.append(pair[0][0])
    assert set(draws) == {3, 6}


def test_a_rejection_in_one_request_leaves_the_next_one_to_its_own_rule() -> None:
    """The first request's draft is rejected; the second's (p(4) = 1/2 over q(4) = 0.01) is
    accepted every time."""
    q = torch.full((1, V), 0.99 / (V - 1))
    q[0, 4] = 0.01
    logits = _rows({3: 0.0}, {2: 0.0}, {3: 0.0, 4: 0.0}, {6: 0.0}, rest=NEG)
    for seed in range(12):
        reqs = [_req("a", temperature=1.0, seed=seed), _req("b", temperature=1.0, seed=seed)]
        out = _verify(logits.clone(), reqs, [[5], [4]], probs=[_one_hot(5), q])
        assert _ids(out) == [[3], [4, 6]], seed


def test_the_target_distribution_of_rejection_sampling_masks_eos_before_min_tokens() -> None:
    logits = _rows({EOS: 5.0, 3: 0.0}, {2: 0.0}, rest=NEG)
    req = _req(temperature=1.0, seed=0, min_new_tokens=1)
    assert _ids(_verify(logits, [req], [[5]], probs=[_one_hot(5)])) == [[3]]


def test_an_accepted_sampled_draft_reports_its_own_logprob() -> None:
    """p = 0.6 on 3 and 0.4 on 4; q(4) = 0.01: 4 is always accepted, and its logprob is
    log 0.4 even where the target's own draw was 3."""
    logits = _rows({3: math.log(0.6), 4: math.log(0.4)}, {2: 0.0}, rest=NEG)
    q = torch.full((1, V), 0.99 / (V - 1))
    q[0, 4] = 0.01
    for seed in range(12):
        req = _req(temperature=1.0, seed=seed, logprobs=True)
        first, _ = _verify(logits.clone(), [req], [[4]], probs=[q])[0]
        assert first[0] == 4 and math.isclose(first[1], math.log(0.4), rel_tol=1e-5), seed
