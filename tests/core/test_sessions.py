"""Sessions keep their KV between turns (core/sessions.py): a growing conversation under a pool
that other traffic fills is served from the cache every turn only with a session; closing
the session frees its pins; pins stay within their share of the pool."""

from __future__ import annotations

from pathlib import Path

import pytest
from platform_choice import on_cpu
from scheduler_checks import check_accounting, greedy, tokens

from radixserve.core import sessions
from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.plugins import default_host
from radixserve.core.request import InvalidRequest, Req
from radixserve.core.sessions import SessionParams

TURNS = 20
NEW_TOKENS = 8  # the user's (or tool's) tokens appended each turn
OUTPUT = 4
POOL = 512  # the whole conversation (20 x 12 tokens) fits, beside little else


def make_core(model_dir: Path, **settings: object) -> EngineCore:
    settings.setdefault("max_total_tokens", POOL)
    settings.setdefault("session_pin_ratio", 0.75)
    return EngineCore(model_dir, EngineConfig(**on_cpu(settings)), default_host())


def run(core: EngineCore, *reqs: Req) -> None:
    for req in reqs:
        core.add_request(req)
    for _ in range(2000):
        if not core.has_work():
            return
        core.step()
        check_pins(core)
    raise AssertionError("no progress")


def check_pins(core: EngineCore) -> None:
    """Between steps the slots add up; at idle only the pins lock cache nodes."""
    sched = core.scheduler
    acct = sched.kv_accounting()
    held = sum(r.kv_len - r.prefix_len for r in sched.running)  # page size 1
    assert acct["in_use"] == held, (acct, sched.running)
    assert acct["free"] + acct["evictable"] + acct["locked"] + held == acct["size"]
    if not sched.running:
        sched.check_no_leak()
        assert acct["locked"] == acct["pinned"] == core.sessions.pinned_tokens()


def other_traffic(turn: int) -> list[Req]:
    """Unrelated prompts that, together, fill the pool: LRU eviction takes whatever is not
    locked, the conversation's history included."""
    seed = 1000 + 10 * turn
    return [Req(f"other-{turn}-{i}", tokens(seed + i, 150), greedy(1)) for i in range(3)]


def conversation(core: EngineCore, session: str | None, seed: int) -> list[tuple[int, int]]:
    """20 turns (their tokens drawn from ``seed``); per turn (previous context length, cached
    tokens reported)."""
    context: list[int] = []
    seen: list[tuple[int, int]] = []
    for turn in range(TURNS):
        new = tokens(seed + turn, NEW_TOKENS)
        if session is None:  # the client sends the whole conversation again
            req = Req(f"turn-{turn}", context + new, greedy(OUTPUT))
        else:  # the session puts its context before the new tokens (SGLang's session_params)
            req = Req(f"turn-{turn}", new, greedy(OUTPUT))
            req.session_params = SessionParams(id=session)
        run(core, req)
        assert req.input_ids == context + new
        seen.append((len(context), req.cached_tokens))
        context = req.input_ids + req.output_ids
        run(core, *other_traffic(turn))
    return seen


def test_a_session_keeps_a_growing_conversation_cached_under_other_traffic(
    tiny_llama_dir: Path,
) -> None:
    core = make_core(tiny_llama_dir)
    without = conversation(core, None, seed=100)
    # Without a session, the other traffic evicts the history between turns.
    short = [cached for previous, cached in without[1:] if cached < previous - 1]
    assert len(short) >= TURNS // 2, without

    session = core.sessions.open_session()
    with_session = conversation(core, session, seed=200)
    for previous, cached in with_session[1:]:
        # the whole previous context but its last sampled token, which never ran (no KV yet)
        assert cached == previous - 1, with_session
    assert with_session[0][1] == 0
    pinned = core.scheduler.kv_accounting()["pinned"]
    assert pinned == TURNS * (NEW_TOKENS + OUTPUT) - 1

    core.sessions.close_session(session)
    acct = core.scheduler.kv_accounting()
    assert acct["locked"] == acct["pinned"] == 0
    core.scheduler.check_no_leak()


def test_pins_stay_within_their_share_oldest_dropped_first(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir, max_total_tokens=768, session_pin_ratio=0.25)  # 192
    limit = core.sessions.pin_limit
    ids = [core.sessions.open_session(session_id=f"s{i}") for i in range(3)]
    for i, sid in enumerate(ids):
        req = Req(f"r{i}", tokens(50 + i, 80), greedy(4))
        req.session_params = SessionParams(id=sid)
        run(core, req)
    pinned = {s.id: s.pinned_tokens for s in core.sessions.sessions.values()}
    assert pinned["s0"] == 0 and pinned["s1"] > 0 and pinned["s2"] > 0, pinned
    assert core.scheduler.kv_accounting()["pinned"] <= limit
    assert core.sessions.demoted == 1
    # one turn larger than the whole share is not pinned; the others keep theirs
    big = Req("big", tokens(60, 250), greedy(2))
    big.session_params = SessionParams(id="s0")
    run(core, big)
    assert core.sessions.sessions["s0"].pin is None
    for sid in ids:
        core.sessions.close_session(sid)
    assert core.scheduler.kv_accounting()["locked"] == 0


def test_session_params_are_checked_and_followed(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    req = Req("x", tokens(1, 8), greedy(2))
    req.session_params = SessionParams(id="nope")
    with pytest.raises(InvalidRequest, match="unknown session 'nope'"):
        core.add_request(req)
    sid = core.sessions.open_session(capacity=40)
    with pytest.raises(InvalidRequest, match="already open"):
        core.sessions.open_session(session_id=sid)
    first = Req("first", tokens(2, 10), greedy(4))
    first.session_params = SessionParams(id=sid)
    run(core, first)
    # continue from the first request's prompt only, cut at 6 tokens
    second = Req("second", tokens(3, 5), greedy(2))
    second.session_params = SessionParams(id=sid, rid="first", offset=6, drop_previous_output=True)
    run(core, second)
    assert second.input_ids == first.input_ids[:6] + tokens(3, 5)
    unknown = Req("third", tokens(4, 5), greedy(2))
    unknown.session_params = SessionParams(id=sid, rid="missing")
    with pytest.raises(InvalidRequest, match="'missing' is not a finished request"):
        core.add_request(unknown)
    too_long = Req("long", tokens(5, 40), greedy(2))
    too_long.session_params = SessionParams(id=sid)
    with pytest.raises(InvalidRequest, match="capacity of 40"):
        core.add_request(too_long)
    core.sessions.close_session(sid)
    with pytest.raises(InvalidRequest, match=f"unknown session '{sid}'"):
        core.sessions.close_session(sid)


def test_a_session_expires_after_its_ttl(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    now = [0.0]
    core.sessions.clock = lambda: now[0]
    sid = core.sessions.open_session(ttl_s=10.0)
    req = Req("r", tokens(7, 20), greedy(2))
    req.session_params = SessionParams(id=sid)
    run(core, req)
    assert core.scheduler.kv_accounting()["pinned"] > 0
    now[0] = 11.0
    run(core, Req("other", tokens(8, 4), greedy(1)))  # a step polls the sessions
    assert sid not in core.sessions.sessions
    assert core.scheduler.kv_accounting()["locked"] == 0
    check_accounting(core)


def test_a_session_remembers_only_its_newest_requests(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sessions, "KEPT_REQUESTS", 1)
    core = make_core(tiny_llama_dir)
    sid = core.sessions.open_session()
    for rid in ("a", "b"):
        req = Req(rid, tokens(ord(rid), 6), greedy(1))
        req.session_params = SessionParams(id=sid)
        run(core, req)
    old = Req("c", tokens(3, 4), greedy(1))
    old.session_params = SessionParams(id=sid, rid="a")
    with pytest.raises(InvalidRequest, match="'a' is not a finished request"):
        core.add_request(old)
    assert list(core.sessions.sessions[sid].contexts) == ["b"]
    core.sessions.close_session(sid)
