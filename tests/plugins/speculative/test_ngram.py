"""The ``ngram`` speculative plugin: matching, adaptive length, incremental indexing, cost."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from radixserve.core.config import EngineConfig
from radixserve.core.interfaces import Draft
from radixserve.core.plugins import PluginHost
from radixserve.core.request import Req, SamplingParams
from radixserve.plugins.speculative import ngram as ngram_module
from radixserve.plugins.speculative.ngram import (
    NgramIndex,
    NgramSpeculation,
    SharedNgramIndex,
    draft_limit,
)


def make_req(rid: str, prompt: list[int], output: list[int] | None = None) -> Req:
    req = Req(rid, list(prompt), SamplingParams())
    req.output_ids = list(output or [])
    return req


def propose1(spec: NgramSpeculation, req: Req, k: int) -> list[int]:
    (draft,) = spec.propose([req], [k])
    assert isinstance(draft, Draft)
    assert draft.probs is None
    return draft.tokens


def reference(history: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Brute force: longest trailing n-gram, latest earlier occurrence, adaptive length."""
    length = len(history)
    for n in range(min(hi, length - 1), lo - 1, -1):
        tail = history[length - n :]
        # occurrences ending at end - 1 < length - 1, latest first
        for end in range(length - 1, n - 1, -1):
            if history[end - n : end] == tail:
                return history[end : end + draft_limit(n, k, hi)]
    return []


def test_repeated_phrase_is_proposed_after_its_prefix_reappears() -> None:
    spec = NgramSpeculation(shared_max_requests=0)
    phrase = [101, 102, 103, 104, 105, 106, 107, 108]
    prompt = [1, 2, 3, *phrase, 4, 5, 6]
    req = make_req("a", prompt)
    # Output starts repeating the phrase: after 3 of its tokens, the rest is proposed.
    req.output_ids = phrase[:3]
    assert propose1(spec, req, 5) == phrase[3:8]
    req.output_ids = phrase[:5]
    # n = 5 < 12: limit min(8, 2 * 5) = 8, running on past the phrase into the prompt.
    assert propose1(spec, req, 8) == [*phrase[5:], 4, 5, 6, 101, 102]


def test_longest_match_wins_over_a_shorter_more_recent_one() -> None:
    spec = NgramSpeculation(shared_max_requests=0)
    # [7, 8, 9] -> 50 long ago; [8, 9] -> 60 more recently. Trailing [7, 8, 9] must pick 50.
    prompt = [7, 8, 9, 50, 51, 52, 1, 2, 8, 9, 60, 61, 62, 3]
    req = make_req("a", prompt, [7, 8, 9])
    assert propose1(spec, req, 4) == [50, 51, 52, 1]
    # With only [8, 9] trailing (no preceding 7), the most recent occurrence wins.
    req2 = make_req("b", prompt, [4, 8, 9])
    assert propose1(spec, req2, 4) == [60, 61, 62, 3]


def test_most_recent_occurrence_among_equal_lengths() -> None:
    spec = NgramSpeculation(shared_max_requests=0)
    prompt = [1, 2, 3, 10, 11, 1, 2, 3, 20, 21, 5]
    req = make_req("a", prompt, [1, 2, 3])
    assert propose1(spec, req, 2) == [20, 21]


def test_adaptive_length_rule() -> None:
    assert draft_limit(1, 8, 12) == 2
    assert draft_limit(2, 8, 12) == 4
    assert draft_limit(3, 8, 12) == 6
    assert draft_limit(5, 8, 12) == 8
    assert draft_limit(12, 30, 12) == 30
    assert draft_limit(1, 1, 12) == 1
    spec = NgramSpeculation(shared_max_requests=0)
    # Only a 1-gram match ([5] -> 6, 7, 8, ...): at most 2 tokens although k = 6.
    req = make_req("a", [5, 6, 7, 8, 9, 10, 11], [5])
    assert propose1(spec, req, 6) == [6, 7]


def test_draft_never_exceeds_max_drafts_nor_the_history() -> None:
    spec = NgramSpeculation(min_window=1, max_window=3, shared_max_requests=0)
    # The match is near the end: only 1 token follows it.
    req = make_req("a", [9, 9, 1, 2, 3, 4], [1, 2, 3])
    # [1, 2, 3] matched at end=5 -> [4, 1, 2, 3] but limited to the history's own tokens.
    assert propose1(spec, req, 10) == [4, 1, 2, 3]
    rng = random.Random(7)
    for i in range(200):
        hist = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        k = rng.randrange(0, 9)
        req = make_req(f"r{i}", hist[: len(hist) // 2], hist[len(hist) // 2 :])
        toks = propose1(spec, req, k)
        assert len(toks) <= k
        assert len(toks) <= max(0, len(hist) - 1)


def test_no_draft_cases() -> None:
    spec = NgramSpeculation(shared_max_requests=0)
    assert propose1(spec, make_req("empty", []), 4) == []
    assert propose1(spec, make_req("one", [5]), 4) == []
    assert propose1(spec, make_req("fresh", [1, 2, 3, 4]), 4) == []  # no repeat, no output
    assert propose1(spec, make_req("k0", [1, 2, 1], [2]), 0) == []
    # Empty output but the prompt repeats itself: the prompt alone is a history.
    assert propose1(spec, make_req("p", [1, 2, 3, 1, 2]), 4) == [3, 1, 2]


def test_history_shorter_than_min_window() -> None:
    spec = NgramSpeculation(min_window=3, max_window=5, shared_max_requests=0)
    assert propose1(spec, make_req("a", [1, 2]), 4) == []
    assert propose1(spec, make_req("b", [1, 2, 3]), 4) == []
    # Only 2-gram repeats: below the min window, so no draft.
    assert propose1(spec, make_req("c", [1, 2, 9, 1, 2]), 4) == []
    assert propose1(spec, make_req("d", [1, 2, 3, 9, 1, 2, 3]), 4) == [9, 1, 2, 3]


@pytest.mark.parametrize(("lo", "hi"), [(1, 12), (1, 3), (2, 4), (3, 3)])
def test_incremental_matches_fresh_and_brute_force(lo: int, hi: int) -> None:
    rng = random.Random(1234 + lo * 100 + hi)
    inc = NgramSpeculation(min_window=lo, max_window=hi, shared_max_requests=0)
    for trial in range(12):
        vocab = rng.choice([2, 3, 5])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        req = make_req(f"t{trial}", prompt)
        for _step in range(40):
            k = rng.randrange(0, 8)
            got = propose1(inc, req, k)
            history = req.input_ids + req.output_ids
            fresh = NgramSpeculation(min_window=lo, max_window=hi, shared_max_requests=0)
            assert got == propose1(fresh, make_req("x", history), k)
            assert got == reference(history, k, lo, hi)
            # The output grows by 1..k+1 tokens, sometimes taking the draft's prefix.
            accepted = rng.randrange(0, len(got) + 1)
            req.output_ids.extend(got[:accepted])
            req.output_ids.append(rng.randrange(vocab))
            if rng.random() < 0.1:  # retracted: state dropped, indexed afresh next time
                inc.release(req.rid)
        inc.release(req.rid)


def test_index_match_end_positions() -> None:
    idx = NgramIndex(1, 4)
    idx.extend([1, 2, 3])
    idx.extend([4, 1, 2])
    assert idx.match([1, 2]) == (2, 2)
    assert idx.match([9, 3]) == (1, 3)
    assert idx.match([2]) == (1, 2)
    assert idx.match([7]) is None
    # The trailing token (2 at position 5) has no follower: not its own match.
    assert idx.lookup(5) == (2, [3, 4, 1, 2])
    assert idx.lookup(3) == (2, [3, 4, 1])
    with pytest.raises(ValueError):
        NgramIndex(0, 3)
    with pytest.raises(ValueError):
        NgramSpeculation(min_window=4, max_window=2)


def test_output_reset_rebuilds_the_index() -> None:
    spec = NgramSpeculation(shared_max_requests=0)
    req = make_req("a", [1, 2, 3, 4, 5], [1, 2])
    assert propose1(spec, req, 3) == [3, 4, 5]
    # Same rid, fresh request: different prompt, shorter output.
    req2 = make_req("a", [7, 8, 9, 7], [])
    assert propose1(spec, req2, 3) == [8, 9]
    # Same lengths as indexed but a different last token: also rebuilt.
    req3 = make_req("a", [7, 8, 9, 6], [])
    assert propose1(spec, req3, 3) == []
    req4 = make_req("a", [7, 8, 9, 6], [5, 7])
    propose1(spec, req4, 3)
    req4.output_ids = [5, 9]
    assert propose1(spec, req4, 3) == propose1(
        NgramSpeculation(shared_max_requests=0), make_req("z", [7, 8, 9, 6, 5, 9]), 3
    )


def test_release_drops_state_and_unknown_rids_are_ignored() -> None:
    spec = NgramSpeculation(shared_max_requests=0)
    spec.release("never-seen")
    req = make_req("a", [1, 2, 3, 1], [2])
    assert propose1(spec, req, 3) == [3, 1, 2]
    assert "a" in spec._states
    spec.release("a")
    assert "a" not in spec._states
    spec.release("a")
    # A retracted request that comes back is indexed afresh and proposes the same.
    assert propose1(spec, req, 3) == [3, 1, 2]


def test_verified_is_a_no_op() -> None:
    spec = NgramSpeculation()
    req = make_req("a", [1, 2, 1])
    propose1(spec, req, 2)
    spec.verified([req], [1])


def test_shared_index_used_for_other_requests() -> None:
    spec = NgramSpeculation()
    first = make_req("first", [40, 41], [10, 11, 12, 13, 14, 15, 16, 17])
    propose1(spec, first, 4)
    spec.release("first")
    assert spec.shared.num_requests == 1
    # A new request whose own history has no match for [10, 11, 12] drafts from "first".
    second = make_req("second", [99, 10, 11, 12])
    assert propose1(spec, second, 4) == [13, 14, 15, 16]
    # Its own (equally long) match wins a tie.
    third = make_req("third", [10, 11, 12, 77, 10, 11, 12])
    assert propose1(spec, third, 2) == [77, 10]
    # Off when shared_max_requests = 0.
    off = NgramSpeculation(shared_max_requests=0)
    propose1(off, make_req("first", [40, 41], [10, 11, 12, 13]), 4)
    off.release("first")
    assert propose1(off, make_req("second", [99, 10, 11, 12]), 4) == []


def test_shared_index_is_bounded() -> None:
    shared = SharedNgramIndex(1, 4, max_requests=3, max_tokens=50)
    for i in range(10):
        shared.add([1000 * i + j for j in range(20)])
        assert shared.num_requests <= 3
        assert shared.num_tokens <= 50
    # Only the newest requests remain; evicted ones leave no keys behind.
    assert shared.lookup([9000, 9001], 4, 1) == (2, [9002, 9003, 9004, 9005])
    assert shared.lookup([0, 1], 4, 1) == (0, [])
    live = {t for toks in shared._entries.values() for t in toks}
    for table in shared._tables:
        for key, (seq, _end) in table.items():
            assert seq in shared._entries
            assert set(key) <= live
    # A single request longer than the budget keeps only its tail.
    big = SharedNgramIndex(1, 2, max_requests=3, max_tokens=10)
    big.add(list(range(100)))
    assert big.num_tokens == 10
    assert big.lookup([95], 4, 1) == (1, [96, 97])


def test_per_call_cost_independent_of_history_length() -> None:
    def cost_of_one_step(history_len: int) -> int:
        rng = random.Random(5)
        # Distinct tokens: no n-gram ever repeats, so both histories take the same path.
        prompt = rng.sample(range(10**9), history_len)
        spec = NgramSpeculation()
        req = make_req("a", prompt)
        propose1(spec, req, 4)  # the one-off O(history) build
        req.output_ids.extend([10**9 + 1, 10**9 + 2, 10**9 + 3])
        before = spec.dict_ops
        propose1(spec, req, 4)
        return spec.dict_ops - before

    small, big = cost_of_one_step(200), cost_of_one_step(20_000)
    assert big == small
    # 3 new tokens close 3 positions (12 windows each), plus 12 lookups.
    assert big <= 3 * 12 + 12


def test_per_call_cost_with_matches_is_bounded() -> None:
    rng = random.Random(3)
    spec = NgramSpeculation(shared_max_requests=0)
    req = make_req("a", [rng.randrange(4) for _ in range(20_000)])
    propose1(spec, req, 4)
    for _ in range(100):
        before = spec.dict_ops
        got = propose1(spec, req, 4)
        assert spec.dict_ops - before <= 12  # nothing new to index: lookups only
        new = got[: rng.randrange(len(got) + 1)] + [rng.randrange(4)]
        req.output_ids.extend(new)
        before = spec.dict_ops
        propose1(spec, req, 4)
        # each new token closes one position (12 windows), plus at most 12 lookups
        assert spec.dict_ops - before <= len(new) * 12 + 12


def test_setup_reads_the_window_sizes_from_the_config() -> None:
    spec = NgramSpeculation(shared_max_requests=0)
    cfg = EngineConfig(
        speculative_ngram_min_match_window_size=2, speculative_ngram_max_match_window_size=3
    )
    spec.setup(SimpleNamespace(config=cfg))  # type: ignore[arg-type]
    assert (spec.min_window, spec.max_window) == (2, 3)
    # A 1-gram repeat is below the min window now.
    assert propose1(spec, make_req("a", [5, 6, 7, 8, 5]), 4) == []
    assert propose1(spec, make_req("b", [5, 6, 7, 8, 5, 6]), 4) == [7, 8, 5, 6]


def test_registered_as_ngram() -> None:
    host = PluginHost(load_entry_points=False, extra_plugins=[("speculative_ngram", ngram_module)])
    registration = host.registries["speculative"].get("ngram")
    algo = registration.factory()
    assert isinstance(algo, NgramSpeculation)
