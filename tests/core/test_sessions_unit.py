"""core/sessions.py without a model: a SessionTable on a real RadixCache, turns fed by hand
(the prompt a session builds, the turns it remembers, the pins it moves and drops)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import FinishReason, InvalidRequest, Req, SamplingParams
from radixserve.core.sessions import KEPT_REQUESTS, Session, SessionParams, SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_table(pool: int = 100, ratio: float = 0.5) -> tuple[SessionTable, RadixCache, Clock]:
    cache = RadixCache(TokenAllocator(pool), ReqToTokenPool(4, 256))
    clock = Clock()
    return SessionTable(cache, pool, ratio, clock=clock), cache, clock


def turn(
    table: SessionTable,
    rid: str,
    prompt: list[int],
    output: list[int],
    extra_key: str | None = None,
    reason: str = "length",
    **params: Any,
) -> Req:
    """One request of a session run to its end: prepared, its KV inserted into the cache (as
    releasing it does), finished and reported to the table."""
    req = Req(rid, list(prompt), SamplingParams(), extra_key=extra_key)
    req.session_params = SessionParams(**params)
    table.prepare(req)
    req.output_ids = list(output)
    ids = req.fill_ids()
    slots = table.cache.allocator.alloc(len(ids))
    assert slots is not None
    table.cache.insert(ids, slots, extra_key)
    req.finish(FinishReason(reason))
    table.ended([req])
    return req


def message(err: pytest.ExceptionInfo[InvalidRequest]) -> str:
    return str(err.value)


def test_the_defaults() -> None:
    p = SessionParams("s")
    assert (p.id, p.rid, p.offset, p.replace, p.drop_previous_output, p.append) == (
        "s",
        None,
        None,
        False,
        False,
        True,
    )
    s = Session("s", 10, 2.0)
    assert (s.id, s.capacity, s.ttl_s, s.last_used, s.contexts, s.prompt_lens) == (
        "s",
        10,
        2.0,
        0.0,
        {},
        {},
    )
    assert (s.last_rid, s.pin, s.pinned_tokens, s.pinned_at, s.extra_key) == (
        None,
        None,
        0,
        0,
        None,
    )
    table, cache, _ = make_table(100, 0.25)
    assert (table.cache, table.pin_limit, table.sessions, table.demoted) == (cache, 25, {}, 0)
    assert make_table(10, 0.55)[0].pin_limit == 5  # rounded down
    assert table.describe() == {
        "open_sessions": 0,
        "pinned_tokens": 0,
        "pin_limit": 25,
        "demoted_pins": 0,
    }


def test_the_default_clock_is_monotonic() -> None:
    import time

    cache = RadixCache(TokenAllocator(10), ReqToTokenPool(2, 16))
    assert SessionTable(cache, 10, 0.5).clock is time.monotonic


def test_open_and_close() -> None:
    table, _, clock = make_table()
    assert table.open_session(session_id="a", capacity=1, ttl_s=0.5) == "a"
    session = table.sessions["a"]
    assert (session.id, session.capacity, session.ttl_s, session.last_used) == ("a", 1, 0.5, 100.0)
    fresh = table.open_session()
    assert re.fullmatch("[0-9a-f]{32}", fresh)
    assert table.open_session() != fresh
    assert table.sessions[fresh].capacity is None and table.sessions[fresh].ttl_s is None
    with pytest.raises(InvalidRequest) as err:
        table.open_session(session_id="a")
    assert (message(err), err.value.param) == ("session 'a' is already open", "session_id")
    table.close_session("a")
    assert "a" not in table.sessions
    with pytest.raises(InvalidRequest) as err:
        table.close_session("a")
    assert message(err) == (
        "unknown session 'a': open one with /open_session first, or it was closed or expired"
    )
    assert err.value.param == "session_params"
    clock.now += 1e9
    assert table.open_session(session_id="a") == "a"  # once closed, the id may be used again


@pytest.mark.parametrize(
    ("settings", "text"),
    [
        ({"capacity": 0}, "capacity_of_str_len must be positive, got 0"),
        ({"capacity": -3}, "capacity_of_str_len must be positive, got -3"),
        ({"ttl_s": 0}, "ttl must be a positive number of seconds, got 0"),
        ({"ttl_s": -1.5}, "ttl must be a positive number of seconds, got -1.5"),
    ],
)
def test_bad_session_settings(settings: dict[str, Any], text: str) -> None:
    table, _, _ = make_table()
    with pytest.raises(InvalidRequest) as err:
        table.open_session(**settings)
    assert message(err) == text
    assert table.sessions == {}


def test_a_session_expires_only_past_its_ttl() -> None:
    table, _, clock = make_table()
    table.open_session(session_id="short", ttl_s=5)
    table.open_session(session_id="forever")
    clock.now += 5
    assert table.expire() == []  # exactly its TTL: still open
    assert table.poll() == []
    assert set(table.sessions) == {"short", "forever"}
    clock.now += 0.001
    assert table.poll() == []
    assert set(table.sessions) == {"forever"}
    table.open_session(session_id="b", ttl_s=1)
    clock.now += 2
    assert table.expire() == ["b"]
    clock.now += 1e9
    assert table.expire() == []


def test_opening_a_session_closes_the_expired_ones() -> None:
    table, _, clock = make_table()
    table.open_session(session_id="old", ttl_s=1)
    clock.now += 2
    table.open_session(session_id="new")
    assert set(table.sessions) == {"new"}


def test_use_keeps_a_session_alive() -> None:
    table, _, clock = make_table()
    table.open_session(session_id="s", ttl_s=10)
    clock.now += 8
    req = Req("r", [1], SamplingParams())
    req.session_params = SessionParams("s")
    table.prepare(req)
    assert table.sessions["s"].last_used == 108
    clock.now += 8
    assert table.expire() == []
    clock.now += 3
    assert table.expire() == ["s"]


def test_turns_build_on_the_sessions_context() -> None:
    table, cache, _ = make_table()
    table.open_session(session_id="s")
    first = turn(table, "t1", [1, 2, 3], [4, 5], id="s")
    assert (first.input_ids, first.context_tokens) == ([1, 2, 3], 0)
    session = table.sessions["s"]
    assert session.contexts == {"t1": [1, 2, 3, 4, 5]}
    assert (session.prompt_lens, session.last_rid) == ({"t1": 3}, "t1")
    second = turn(table, "t2", [6], [7], id="s")
    assert (second.input_ids, second.context_tokens) == ([1, 2, 3, 4, 5, 6], 5)
    assert session.contexts["t2"] == [1, 2, 3, 4, 5, 6, 7] and session.last_rid == "t2"
    # from an older turn, without its output, or a prefix of it
    req = Req("x", [9], SamplingParams())
    req.session_params = SessionParams("s", rid="t1")
    table.prepare(req)
    assert (req.input_ids, req.context_tokens) == ([1, 2, 3, 4, 5, 9], 5)
    req = Req("x", [9], SamplingParams())
    req.session_params = SessionParams("s", rid="t2", drop_previous_output=True)
    table.prepare(req)
    assert (req.input_ids, req.context_tokens) == ([1, 2, 3, 4, 5, 6, 9], 6)
    for offset, expected in [(0, []), (2, [1, 2]), (7, [1, 2, 3, 4, 5, 6, 7]), (-1, None)]:
        req = Req("x", [9], SamplingParams())
        req.session_params = SessionParams("s", offset=offset)
        table.prepare(req)
        context = [1, 2, 3, 4, 5, 6, 7] if expected is None else expected
        assert (req.input_ids, req.context_tokens) == (context + [9], len(context))
    # the OpenAI routes send the whole conversation: nothing is put before it
    req = Req("x", [1, 2], SamplingParams())
    req.session_params = SessionParams("s", append=False)
    table.prepare(req)
    assert (req.input_ids, req.context_tokens) == ([1, 2], 0)
    # a request outside any session is left alone
    req = Req("x", [1, 2], SamplingParams())
    table.prepare(req)
    assert (req.input_ids, req.context_tokens) == ([1, 2], 0)
    assert cache.locked_size == 7


def test_bad_session_params() -> None:
    table, _, _ = make_table()
    table.open_session(session_id="s", capacity=6)
    turn(table, "t1", [1, 2, 3], [4], id="s")

    def refused(params: SessionParams, prompt: tuple[int, ...] = (9,)) -> InvalidRequest:
        req = Req("x", list(prompt), SamplingParams())
        req.session_params = params
        with pytest.raises(InvalidRequest) as err:
            table.prepare(req)
        assert err.value.param == "session_params"
        return err.value

    assert str(refused(SessionParams("s", rid="nope"))) == (
        "request 'nope' is not a finished request of session 's'"
    )
    assert str(refused(SessionParams("s", offset=5))) == (
        "session_params.offset 5 is past the 4 tokens of request 't1'"
    )
    assert str(refused(SessionParams("s", offset=4, drop_previous_output=True))) == (
        "session_params.offset 4 is past the 3 tokens of request 't1'"
    )
    assert str(refused(SessionParams("s"), (9, 9, 9))) == (
        "the request holds 7 tokens with session 's''s context, past the session's capacity of 6"
    )
    assert str(refused(SessionParams("s", append=False), (1,) * 7)).startswith(
        "the request holds 7 tokens"
    )
    assert str(refused(SessionParams("gone"))).startswith("unknown session 'gone'")
    req = Req("x", [9, 9], SamplingParams())  # exactly the capacity
    req.session_params = SessionParams("s")
    table.prepare(req)
    assert len(req.input_ids) == 6


@pytest.mark.parametrize("how", ["unfinished", "failed", "abort", "no session", "closed"])
def test_turns_that_are_not_recorded(how: str) -> None:
    table, cache, _ = make_table()
    table.open_session(session_id="s")
    req = Req("r", [1, 2], SamplingParams())
    req.session_params = None if how == "no session" else SessionParams("s")
    req.output_ids = [3]
    cache.insert([1, 2, 3], cache.allocator.alloc(3))
    if how != "unfinished":
        req.finish(FinishReason("abort" if how == "abort" else "stop", matched=3))
    if how == "failed":
        req.failed = "boom"
    if how == "closed":
        table.close_session("s")
    table.ended([req])
    if how != "closed":
        session = table.sessions["s"]
        assert (session.contexts, session.last_rid, session.pin) == ({}, None, None)
    assert cache.locked_size == 0


def test_turns_of_several_requests_are_all_recorded() -> None:
    table, cache, _ = make_table()
    table.open_session(session_id="a")
    table.open_session(session_id="b")
    reqs = []
    for sid, ids in (("a", [1, 2]), ("b", [5, 6, 7])):
        req = Req(sid + "1", ids, SamplingParams())
        req.session_params = SessionParams(sid)
        cache.insert(ids, cache.allocator.alloc(len(ids)))
        req.finish(FinishReason("stop", matched=ids[-1]))
        reqs.append(req)
    table.ended(reqs)
    assert table.sessions["a"].contexts == {"a1": [1, 2]}
    assert table.sessions["b"].contexts == {"b1": [5, 6, 7]}
    assert table.pinned_tokens() == 5 == cache.locked_size


def test_replace_forgets_the_other_turns() -> None:
    table, _, _ = make_table()
    table.open_session(session_id="s")
    turn(table, "t1", [1], [2], id="s")
    turn(table, "t2", [3], [4], id="s", replace=True)
    session = table.sessions["s"]
    assert session.contexts == {"t2": [1, 2, 3, 4]}
    assert session.prompt_lens == {"t2": 3}


def test_a_session_remembers_its_newest_turns() -> None:
    table, _, clock = make_table(pool=1000)
    table.open_session(session_id="s")
    for i in range(KEPT_REQUESTS + 2):
        clock.now += 1
        turn(table, f"t{i}", [i], [], id="s", append=False)
    session = table.sessions["s"]
    kept = [f"t{i}" for i in range(2, KEPT_REQUESTS + 2)]
    assert list(session.contexts) == kept
    assert list(session.prompt_lens) == kept
    assert session.last_used == clock.now
    assert KEPT_REQUESTS == 16


def test_the_pin_moves_to_the_newest_turn() -> None:
    table, cache, _ = make_table()
    table.open_session(session_id="s")
    turn(table, "t1", [1, 2, 3], [4], id="s")
    session = table.sessions["s"]
    assert (session.pinned_tokens, session.pinned_at, cache.locked_size) == (4, 1, 4)
    assert session.pin.key == [1, 2, 3, 4]
    turn(table, "t2", [5], [6], id="s")
    # the shared prefix stays locked; the old pin's node is not locked twice
    assert (session.pinned_tokens, session.pinned_at, cache.locked_size) == (6, 2, 6)
    assert table.pinned_tokens() == 6
    # a turn whose KV is not cached takes no pin, and drops the old one
    req = Req("t3", [7], SamplingParams())
    req.session_params = SessionParams("s", append=False)
    req.finish(FinishReason("length", length=1))
    table.ended([req])
    assert (session.pin, session.pinned_tokens, cache.locked_size) == (None, 0, 0)
    assert session.last_rid == "t3"


def test_pins_are_per_namespace() -> None:
    table, cache, _ = make_table()
    table.open_session(session_id="s")
    turn(table, "t1", [1, 2], [3], id="s", extra_key="lora-a")
    session = table.sessions["s"]
    assert (session.pinned_tokens, session.extra_key, cache.locked_size) == (3, "lora-a", 3)
    # the same tokens cached in the default namespace only: nothing to pin in lora-a
    req = Req("t2", [8, 9], SamplingParams(), extra_key="lora-b")
    req.session_params = SessionParams("s", append=False)
    cache.insert([8, 9], cache.allocator.alloc(2))
    req.finish(FinishReason("length", length=1))
    table.ended([req])
    assert (session.pin, cache.locked_size, session.extra_key) == (None, 0, "lora-a")


def test_a_pin_larger_than_the_bound_is_not_taken() -> None:
    table, cache, _ = make_table(pool=20, ratio=0.25)  # 5 tokens
    table.open_session(session_id="s")
    turn(table, "t1", [1, 2, 3, 4, 5, 6], [], id="s")
    assert (table.sessions["s"].pin, cache.locked_size, table.demoted) == (None, 0, 0)
    turn(table, "t2", [1, 2, 3, 4, 5], [], id="s", append=False)  # exactly the bound
    assert (table.sessions["s"].pinned_tokens, cache.locked_size) == (5, 5)


def test_pins_past_the_bound_drop_the_oldest_first() -> None:
    table, cache, _ = make_table(pool=40, ratio=0.25)  # 10 tokens
    for sid in "abcd":
        table.open_session(session_id=sid)
    turn(table, "a1", [1, 1, 1], [], id="a")
    turn(table, "b1", [2, 2, 2], [], id="b")
    turn(table, "c1", [3, 3, 3, 3], [], id="c")  # 10 pinned: exactly the bound
    assert (table.demoted, cache.locked_size, table.pinned_tokens()) == (0, 10, 10)
    turn(table, "d1", [4, 4, 4], [], id="d")  # drops a's pin only
    pins = {sid: s.pinned_tokens for sid, s in table.sessions.items()}
    assert pins == {"a": 0, "b": 3, "c": 4, "d": 3}
    assert table.sessions["a"].pin is None
    assert (table.demoted, cache.locked_size) == (1, 10)
    turn(table, "a2", [5] * 7, [], id="a", append=False)  # drops b's and c's
    pins = {sid: s.pinned_tokens for sid, s in table.sessions.items()}
    assert pins == {"a": 7, "b": 0, "c": 0, "d": 3}
    assert (table.demoted, cache.locked_size) == (3, 10)
    assert table.describe() == {
        "open_sessions": 4,
        "pinned_tokens": 10,
        "pin_limit": 10,
        "demoted_pins": 3,
    }
    # a session's newer turn: its own old pin is replaced (neither counted against the bound
    # nor as demoted); a's 7 + d's 4 pass the bound, so a's pin goes
    turn(table, "d2", [4, 4, 4], [6], id="d", append=False)
    assert (table.demoted, table.sessions["d"].pinned_tokens, cache.locked_size) == (4, 4, 4)
    assert table.sessions["a"].pin is None


def test_shared_prefixes_are_counted_once() -> None:
    table, cache, _ = make_table()
    table.open_session(session_id="a")
    table.open_session(session_id="b")
    turn(table, "a1", [1, 2, 3], [4], id="a")
    turn(table, "b1", [1, 2, 3], [5, 6], id="b", append=False)
    # [1, 2, 3] under both, then [4] and [5, 6]
    assert table.pinned_tokens() == 6 == cache.locked_size
    table.close_session("a")
    assert table.pinned_tokens() == 5 == cache.locked_size
    assert table.sessions["b"].pinned_tokens == 5


def test_unpin_all_keeps_the_sessions_open() -> None:
    table, cache, _ = make_table()
    table.open_session(session_id="a")
    table.open_session(session_id="b")
    turn(table, "a1", [1, 2], [3], id="a")
    turn(table, "b1", [7], [8], id="b")
    table.unpin_all()
    assert cache.locked_size == 0 and table.pinned_tokens() == 0
    assert all(s.pin is None and s.pinned_tokens == 0 for s in table.sessions.values())
    assert set(table.sessions) == {"a", "b"}
    assert table.sessions["a"].contexts == {"a1": [1, 2, 3]}
    # the cache can now evict it all
    assert cache.evict(100) == 5


def test_closing_and_expiring_drop_pins() -> None:
    table, cache, clock = make_table()
    table.open_session(session_id="a", ttl_s=3)
    table.open_session(session_id="b")
    turn(table, "a1", [1, 2], [3], id="a")
    turn(table, "b1", [7], [8], id="b")
    assert cache.locked_size == 5
    clock.now += 4
    assert table.poll() == [] and set(table.sessions) == {"b"}
    assert cache.locked_size == 2
    table.close_session("b")
    assert cache.locked_size == 0 and table.sessions == {}


@pytest.mark.parametrize("how", ["unfinished", "abort"])
def test_a_turn_not_recorded_does_not_stop_the_others_in_its_batch(how: str) -> None:
    table, cache, _ = make_table()
    table.open_session(session_id="s")
    skipped = Req("skipped", [5, 6], SamplingParams())
    skipped.session_params = SessionParams("s")
    if how == "abort":
        skipped.finish(FinishReason("abort", message="cancelled"))
    req = Req("r", [1], SamplingParams())  # a one-token context is pinned too
    req.session_params = SessionParams("s")
    cache.insert([1], cache.allocator.alloc(1))
    req.finish(FinishReason("length", length=1))
    table.ended([skipped, req])
    session = table.sessions["s"]
    assert (session.contexts, session.pinned_tokens, cache.locked_size) == ({"r": [1]}, 1, 1)
