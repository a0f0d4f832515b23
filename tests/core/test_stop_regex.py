"""``stop_regex`` in the stop checker: the longest text a pattern can match (which bounds the
window searched at each token; None means search the whole output), and the match itself: the
earliest end wins, ties go to the pattern listed first, the text is cut after the match."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from radixserve.core import stop
from radixserve.core.request import FinishReason, Req, SamplingParams


@pytest.mark.parametrize(
    ("pattern", "width"),
    [
        ("abc", 3),
        ("[a-z]x", 2),  # a class
        ("[^a]b", 2),  # a negated literal
        (".", 1),
        ("^ab$", 2),  # anchors take no text
        (r"\bab", 2),
        ("(ab)c", 3),
        ("a|bcd", 3),  # the widest branch
        ("a{2,4}", 4),
        ("(?:ab){3}", 6),
        ("a{1,3}?", 3),  # lazy, bounded
        ("a{0,2}+", 2),  # possessive, bounded
        ("(?=abc)ab", 5),  # a lookahead reads past the match: counted
        ("(?!ab)c", 3),
        ("(?<=x)ab", 2),  # a lookbehind reads before it: not counted
        ("(?<!xy)c", 1),
        ("a+", None),
        ("a*", None),
        ("a*?", None),
        ("a{2,}", None),
        ("a|b+", None),  # one unbounded branch
        ("(?:a+)b", None),
        (r"(a)\1", None),  # a backreference
        ("(?>ab)", None),  # an atomic group
    ],
)
def test_the_longest_text_a_pattern_can_match(pattern: str, width: int | None) -> None:
    assert stop._compiled(pattern)[1] == width


def _req(*patterns: str) -> Req:
    return Req("r", [0], SamplingParams(stop_regex=list(patterns)))


def _match(req: Req, text: str, delta_len: int) -> tuple[bool, Any]:
    detok = SimpleNamespace(text=text)
    return stop._match_stop_regex(req, detok, delta_len), detok  # type: ignore[arg-type]


def test_a_match_ends_the_request_and_cuts_the_text_after_it() -> None:
    req = _req("b[0-9]")
    found, detok = _match(req, "ab1cd", 5)
    assert found is True and detok.text == "ab1"
    assert req.finish_reason == FinishReason("stop", matched="b[0-9]")


def test_no_match_changes_nothing() -> None:
    req = _req("zz", "q+")
    found, detok = _match(req, "abcd", 4)
    assert found is False and detok.text == "abcd" and not req.finished


def test_a_bounded_pattern_at_the_very_start_is_found() -> None:
    req = _req("ab")
    found, detok = _match(req, "ab", 2)  # the first token's text: the window starts at 0
    assert found and detok.text == "ab"


def test_the_earliest_end_wins_and_ties_go_to_the_first_listed_pattern() -> None:
    req = _req("cd", "b")
    assert _match(req, "abcd", 4)[1].text == "ab"
    assert req.finish_reason == FinishReason("stop", matched="b")
    tie = _req("b", "ab")
    assert _match(tie, "xab", 3)[1].text == "xab"
    assert tie.finish_reason == FinishReason("stop", matched="b")


def test_a_pattern_that_backtracks_without_end_ends_its_request_not_the_engine() -> None:
    """(x|xx)+y over 40 x's backtracks through ~10^8 paths (minutes with re; far past the
    timeout on any machine): the search stops at the timeout and only this request ends."""
    req = _req("(x|xx)+y")
    found, detok = _match(req, "x" * 40, 1)
    assert found and detok.text == "x" * 40
    assert req.finish_reason is not None and req.finish_reason.type == "abort"
    assert "(x|xx)+y" in (req.finish_reason.message or "")
    assert "catastrophic backtracking" in (req.finish_reason.message or "")
    sane = _req("(x|xx)+y", "z+")  # a later, sane pattern does not rescue the first
    assert _match(sane, "x" * 40 + "zz", 2)[0] and sane.finish_reason.type == "abort"  # type: ignore[union-attr]
