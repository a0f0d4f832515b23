"""Greedy outputs with speculation on equal speculation off on SmolLM2, over the mixed set of
tests/support/speculative_equivalence.py (which says what it holds),
for the n-gram, standalone and eagle3 plugins (n-gram and eagle3 with adaptive draft lengths,
--speculative-adaptive; their fixed lengths run in tests/plugins/speculative and through the
eagle and standalone runs' same core path)."""

import pytest
from speculative_equivalence import (  # noqa: F401 - the fixtures and tests run here
    reference,
    speculative_fixture,
    test_constrained_outputs_stay_valid_under_speculation,
    test_greedy_outputs_equal_speculation_off,
    test_logprobs_equal_speculation_off,
    test_streamed_text_equals_speculation_off,
)

pytestmark = pytest.mark.slow

speculative = speculative_fixture(["ngram-adaptive", "standalone", "eagle3-adaptive"])
