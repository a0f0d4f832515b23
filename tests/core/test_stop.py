"""StopChecker on boundaries, token by token, with a byte-level tokenizer whose tokens are
chosen by the test: stop strings split across two, three and more tokens, a stop string that
begins at the first position of the search window, overlapping stops, stops inside multi-byte
characters, and the length limits (max_new_tokens, context length) at, below and above."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.core.request import Req, SamplingParams
from radixserve.core.stop import StopChecker, streamable_text
from radixserve.core.tokenizer import Tokenizer

EOS = "<eos>"
# Multi-character tokens; every single byte is a token too (id = byte value).
PIECES = [
    "ab",
    "abc",
    "cde",
    "xab",
    "ST",
    "OP",
    "TO",
    "xS",
    "Py",
    "abcd",
    "bcd",
    "Hello",
    " world",
    "abab",
]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ByteLevel decoding reverses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


BYTE_CHARS = _byte_chars()


def _token_str(piece: str | bytes) -> str:
    data = piece.encode() if isinstance(piece, str) else piece
    return "".join(BYTE_CHARS[b] for b in data)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    vocab = {_token_str(bytes([b])): b for b in range(256)}
    for piece in PIECES:
        vocab[_token_str(piece)] = len(vocab)
    eos_id = len(vocab)
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": eos_id,
                "content": EOS,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True},
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
    }
    folder = tmp_path_factory.mktemp("bytetok")
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return Tokenizer(Path(folder))


def tid(tokenizer: Tokenizer, piece: str | bytes) -> int:
    """The id of a token that decodes to exactly ``piece`` (a PIECES entry or one byte)."""
    if isinstance(piece, bytes):
        assert len(piece) == 1
        return piece[0]
    if len(piece.encode()) == 1:
        return piece.encode()[0]
    token_id = tokenizer.token_to_id(_token_str(piece))
    assert token_id is not None, piece
    return token_id


PROMPT = [ord(c) for c in "Q: "]


def run(
    tokenizer: Tokenizer,
    pieces: list[str | bytes],
    max_context: int = 1000,
    prompt: list[int] | None = None,
    **params: object,
) -> tuple[Req, int]:
    """Append ``pieces`` one token each until the request finishes; (req, tokens appended)."""
    params.setdefault("max_new_tokens", 100)
    req = Req("r", list(PROMPT if prompt is None else prompt), SamplingParams(**params))  # type: ignore[arg-type]
    eos = tokenizer.token_to_id(EOS)
    assert eos is not None
    checker = StopChecker(tokenizer, [eos], max_context)
    for n, piece in enumerate(pieces, 1):
        checker.append(req, tid(tokenizer, piece))
        if req.finished:
            return req, n
    return req, len(pieces)


def test_tokenizer_decodes_pieces(tokenizer: Tokenizer) -> None:
    ids = [tid(tokenizer, p) for p in ["Hello", " world", "xab", b"\xc3", b"\xa9"]]
    assert tokenizer.decode(ids) == "Hello worldxabé"


def test_stop_at_first_window_position_is_found(tokenizer: Tokenizer) -> None:
    """'abc' begins one character before the new token "cde" and ends on its first character:
    the very first position of the search window (len(text) - delta - longest + 1)."""
    req, n = run(tokenizer, ["xab", "cde", "Hello"], stop=["abc"])
    assert n == 2 and req.finish_reason is not None
    assert req.finish_reason.type == "stop" and req.finish_reason.matched == "abc"
    assert req.detok.text == "x"


def test_stop_at_first_window_position_with_shorter_stops(tokenizer: Tokenizer) -> None:
    # The window is sized by the longest stop; the longest one starts at its first position.
    req, n = run(tokenizer, ["x", "S", "TO", "Py"], stop=["Q", "STOP"])
    assert n == 4 and req.finish_reason.matched == "STOP"  # type: ignore[union-attr]
    assert req.detok.text == "x"


def test_stop_split_across_two_tokens(tokenizer: Tokenizer) -> None:
    req, n = run(tokenizer, ["Hello", "ST", "OP", "Hello"], stop=["STOP"])
    assert n == 3 and req.finish_reason.matched == "STOP"  # type: ignore[union-attr]
    assert req.detok.text == "Hello"


@pytest.mark.parametrize(
    "pieces",
    [["S", "T", "O", "P"], ["xS", "TO", "Py"], ["x", "S", "T", "OP"], ["xS", "T", "O", "Py"]],
)
def test_stop_split_across_three_or_more_tokens(
    tokenizer: Tokenizer, pieces: list[str | bytes]
) -> None:
    req, n = run(tokenizer, [*pieces, "Hello", "Hello"], stop=["STOP"])
    assert n == len(pieces), req.detok.text
    assert req.finish_reason.type == "stop"  # type: ignore[union-attr]
    assert req.detok.text == "".join(str(p) for p in pieces).split("STOP")[0]


def test_single_character_tokens_stop_on_last_character(tokenizer: Tokenizer) -> None:
    """Each character its own token: the stop starts at the window's first position when its
    last character arrives."""
    req, n = run(tokenizer, list("abcdef"), stop=["abc"])
    assert n == 3 and req.detok.text == ""


def test_stop_not_matched_early_or_across_gaps(tokenizer: Tokenizer) -> None:
    req, n = run(tokenizer, ["ST", "x", "OP", "Hello"], stop=["STOP"])
    assert not req.finished and n == 4
    assert req.detok.text == "STxOPHello"


def test_overlapping_stops_earliest_position_wins(tokenizer: Tokenizer) -> None:
    # Both end in the same token; "abc" begins first.
    req, _ = run(tokenizer, ["x", "abcd"], stop=["bcd", "abc"])
    assert req.finish_reason.matched == "abc" and req.detok.text == "x"  # type: ignore[union-attr]
    # "bc" ends earlier but begins later than "abcd": the earliest start wins.
    req, _ = run(tokenizer, ["abcd"], stop=["bc", "abcd"])
    assert req.finish_reason.matched == "abcd" and req.detok.text == ""  # type: ignore[union-attr]


def test_overlapping_stop_with_itself(tokenizer: Tokenizer) -> None:
    req, n = run(tokenizer, ["a", "b", "a", "b", "a"], stop=["aba"])
    assert n == 3 and req.detok.text == ""


def test_no_stop_trim_keeps_the_stop_text(tokenizer: Tokenizer) -> None:
    req, _ = run(tokenizer, ["xab", "cde"], stop=["abc"], no_stop_trim=True)
    assert req.detok.text == "xabc"


def test_first_occurrence_in_one_token_wins(tokenizer: Tokenizer) -> None:
    req, _ = run(tokenizer, ["x", "abab"], stop=["ab"])
    assert req.detok.text == "x"


def test_stops_at_the_same_position_first_listed_wins(tokenizer: Tokenizer) -> None:
    req, _ = run(tokenizer, ["abcd"], stop=["ab", "abc"], no_stop_trim=True)
    assert req.finish_reason.matched == "ab" and req.detok.text == "ab"  # type: ignore[union-attr]


def test_no_stop_trim_keeps_text_up_to_the_stop_end(tokenizer: Tokenizer) -> None:
    req, _ = run(tokenizer, ["Hello", "xab", "Hello"], stop=["ab"], no_stop_trim=True)
    assert req.detok.text == "Helloxab"


def test_unmatched_stop_strings_still_end_on_length(tokenizer: Tokenizer) -> None:
    req, n = run(tokenizer, ["Hello"] * 5, stop=["zz"], max_new_tokens=3)
    assert n == 3 and req.finish_reason.type == "length"  # type: ignore[union-attr]


def test_stop_on_the_last_allowed_token_reports_stop(tokenizer: Tokenizer) -> None:
    req, n = run(tokenizer, ["Hello", "ST", "OP"], stop=["STOP"], max_new_tokens=3)
    assert n == 3 and req.finish_reason.type == "stop" and req.detok.text == "Hello"  # type: ignore[union-attr]


def test_stops_count_from_exactly_min_new_tokens(tokenizer: Tokenizer) -> None:
    req, n = run(tokenizer, ["ST", "OP", "Hello"], stop=["STOP"], min_new_tokens=2)
    assert n == 2 and req.finish_reason.type == "stop"  # type: ignore[union-attr]
    hello = tid(tokenizer, "Hello")
    req, n = run(tokenizer, ["Hello", "Hello", "a"], stop_token_ids=[hello], min_new_tokens=2)
    assert n == 2 and req.finish_reason.matched == hello  # type: ignore[union-attr]


def test_no_stop_trim_keeps_the_stop_token_text(tokenizer: Tokenizer) -> None:
    hello = tid(tokenizer, "Hello")
    req, n = run(tokenizer, ["a", "Hello"], stop_token_ids=[hello], no_stop_trim=True)
    assert n == 2 and req.detok.text == "aHello"
    req, n = run(tokenizer, ["a", "Hello"], stop_token_ids=[hello])
    assert n == 2 and req.detok.text == "a"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_reaches_the_detokenizer(tokenizer: Tokenizer, skip: bool) -> None:
    eos = tokenizer.token_to_id(EOS)
    checker = StopChecker(tokenizer, [eos], 1000)  # type: ignore[list-item]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, skip_special_tokens=skip)
    req = Req("r", list(PROMPT), params)
    for token in (tid(tokenizer, "a"), eos, tid(tokenizer, "b")):
        checker.append(req, token)  # type: ignore[arg-type]
    assert req.detok.text == ("ab" if skip else f"a{EOS}b")


def test_append_records_tokens_logprobs_and_first_token_time(tokenizer: Tokenizer) -> None:
    checker = StopChecker(tokenizer, [], 1000)
    req = Req("r", list(PROMPT), SamplingParams(max_new_tokens=5, logprobs=True))
    checker.append(req, tid(tokenizer, "a"), -0.5, [(-0.5, 97)])
    first = req.first_token_time
    assert first is not None
    checker.append(req, tid(tokenizer, "b"))
    assert req.output_ids == [97, 98]
    assert req.output_logprobs == [-0.5, 0.0]
    assert req.output_top_logprobs == [[(-0.5, 97)], []]
    assert req.first_token_time == first
    plain = Req("p", list(PROMPT), SamplingParams(max_new_tokens=5))
    checker.append(plain, tid(tokenizer, "a"), -0.5, [(-0.5, 97)])
    assert plain.output_logprobs == [] and plain.output_top_logprobs == []


def test_stop_inside_multibyte_character(tokenizer: Tokenizer) -> None:
    # "é" is c3 a9: its first byte gives no text; the stop matches when the second arrives.
    req, n = run(tokenizer, ["x", b"\xc3", b"\xa9", "Hello"], stop=["é"])
    assert n == 3 and req.finish_reason.matched == "é" and req.detok.text == "x"  # type: ignore[union-attr]
    # "€" is e2 82 ac: three tokens.
    req, n = run(tokenizer, ["ab", b"\xe2", b"\x82", b"\xac", "Hello"], stop=["b€"])
    assert n == 4 and req.detok.text == "a"
    # "è" (c3 a8) shares the first byte with "é" and must not stop.
    req, n = run(tokenizer, [b"\xc3", b"\xa8", "Hello"], stop=["é"])
    assert not req.finished and req.detok.text == "èHello"


def test_stop_string_ignored_before_min_new_tokens(tokenizer: Tokenizer) -> None:
    req, n = run(tokenizer, ["ST", "OP", "ST", "OP"], stop=["STOP"], min_new_tokens=3)
    assert n == 4 and req.detok.text == "STOP"


def test_eos_finishes_unless_ignored(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id(EOS)
    checker = StopChecker(tokenizer, [eos], 1000)  # type: ignore[list-item]
    req = Req("r", list(PROMPT), SamplingParams(max_new_tokens=10))
    checker.append(req, tid(tokenizer, "Hello"))
    checker.append(req, eos)  # type: ignore[arg-type]
    assert req.finish_reason.type == "stop" and req.finish_reason.matched == eos  # type: ignore[union-attr]
    assert req.detok.text == "Hello"
    req = Req("r", list(PROMPT), SamplingParams(max_new_tokens=10, ignore_eos=True))
    checker.append(req, eos)  # type: ignore[arg-type]
    assert not req.finished


@pytest.mark.parametrize("max_new", [1, 2, 5])
def test_max_new_tokens_exact(tokenizer: Tokenizer, max_new: int) -> None:
    req, n = run(tokenizer, ["a"] * 10, max_new_tokens=max_new)
    assert n == max_new and len(req.output_ids) == max_new
    assert req.finish_reason.type == "length" and req.finish_reason.length == max_new  # type: ignore[union-attr]


@pytest.mark.parametrize("room", [1, 2, 5])
def test_context_length_exact(tokenizer: Tokenizer, room: int) -> None:
    """Prompt + output reaches the context length exactly, never one token past it."""
    context = len(PROMPT) + room
    req, n = run(tokenizer, ["a"] * 10, max_context=context)
    assert n == room and len(PROMPT) + len(req.output_ids) == context
    assert req.finish_reason.type == "length" and req.finish_reason.length == room  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("max_new", "room", "expected"),
    [(3, 4, 3), (4, 4, 4), (5, 4, 4)],  # max_new_tokens below, at and above the room left
)
def test_max_new_tokens_against_context_length(
    tokenizer: Tokenizer, max_new: int, room: int, expected: int
) -> None:
    req, n = run(tokenizer, ["a"] * 10, max_context=len(PROMPT) + room, max_new_tokens=max_new)
    assert n == expected and req.finish_reason.type == "length"  # type: ignore[union-attr]


def test_streamable_text_holds_back_a_possible_stop_prefix() -> None:
    assert streamable_text("Hello ST", ["STOP"]) == "Hello "
    assert streamable_text("Hello STO", ["STOP", "TOO"]) == "Hello "
    assert streamable_text("Hello TO", ["STOP", "TOO"]) == "Hello "
    assert streamable_text("Hello S", ["STOP"]) == "Hello "
    assert streamable_text("Hello", ["STOP"]) == "Hello"
    assert streamable_text("ab", ["abc"]) == ""
    assert streamable_text("", ["abc"]) == ""
    # Only a proper prefix is held back: a complete stop string is not a tail that can grow.
    assert streamable_text("xabc", ["abc"]) == "xabc"


# --- stop_regex ----------------------------------------------------------------------------------


def test_stop_regex_split_across_tokens_keeps_the_match_and_cuts_after(
    tokenizer: Tokenizer,
) -> None:
    # "x1" + "2" + "3ab": r"\d{3}" completes inside the third token; "ab" after it is cut.
    req, n = run(tokenizer, ["x", "1", "2", "3", "ab", "Hello"], stop_regex=[r"\d{3}"])
    assert n == 4 and req.detok.text == "x123"
    assert req.finish_reason is not None and req.finish_reason.matched == r"\d{3}"
    req, n = run(tokenizer, ["Py", "abc", "Hello"], stop_regex=[r"y\w"])
    assert n == 2 and req.detok.text == "Pya"


def test_stop_regex_unbounded_pattern_finds_a_match_that_began_long_ago(
    tokenizer: Tokenizer,
) -> None:
    # The match starts at the first token, far before the bounded window of any short pattern.
    pieces: list[str | bytes] = ["S", *["ab"] * 30, "TO", "Hello"]
    req, n = run(tokenizer, pieces, stop_regex=[r"S(ab)+T"])
    assert n == 32 and req.detok.text == "S" + "ab" * 30 + "T"


def test_stop_regex_anchors_lookarounds_and_the_earliest_of_several(
    tokenizer: Tokenizer,
) -> None:
    # ^ anchors at the output's start, not at the search window's start
    req, n = run(tokenizer, ["ab", "ab", "cde"], stop_regex=[r"^c"])
    assert not req.finished and n == 3
    # a lookahead whose text arrives tokens after the match's own characters
    req, n = run(tokenizer, ["x", "y", "Hello", " world"], stop_regex=[r"y(?=Hello w)"])
    assert n == 4 and req.detok.text == "xy"
    # a lookbehind reading before the window
    req, n = run(tokenizer, ["Hello", "ab", "cde"], stop_regex=[r"(?<=Helloab)c"])
    assert n == 3 and req.detok.text == "Helloabc"
    # two patterns: the match that ends first wins, whatever the list order
    req, n = run(tokenizer, ["xab", "cde"], stop_regex=[r"de", r"b"])
    assert n == 1 and req.detok.text == "xab" and req.finish_reason.matched == "b"  # type: ignore[union-attr]


def test_stop_regex_waits_for_min_new_tokens(tokenizer: Tokenizer) -> None:
    req, n = run(tokenizer, ["ab", "x", "ab", "Hello"], stop_regex=["ab"], min_new_tokens=2)
    assert n == 3 and req.detok.text == "abxab"


def test_invalid_stop_regex_is_refused_naming_the_field() -> None:
    from radixserve.core.request import InvalidRequest

    with pytest.raises(InvalidRequest, match="not a valid regular expression") as e:
        SamplingParams.from_dict({"stop_regex": "(unclosed"})
    assert e.value.param == "stop_regex"
    with pytest.raises(InvalidRequest, match="non-empty string"):
        SamplingParams.from_dict({"stop_regex": [""]})
    assert SamplingParams.from_dict({"stop_regex": r"\d"}).stop_regex == [r"\d"]
