"""core/disaggregation.py without a model: a real Scheduler driven by hand (``schedule``, the
token the test chooses, ``process_output``) holds each side's requests and slots, and a
recording KV connector stands for the wire (what each side sends, receives, cancels and
refuses, with the exact reasons). test_disaggregation.py runs both sides on the tiny Llama end
to end; these pin every message, budget and guard in milliseconds (mutation testing runs them
once per mutant)."""

from __future__ import annotations

import logging
import zlib
from array import array
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from hand_scheduler import hand_scheduler

from radixserve.core import disaggregation
from radixserve.core.disaggregation import (
    MAX_IDLE_WAIT_S,
    Bootstrap,
    DecodeSide,
    PrefillSide,
    TransferMeta,
    build,
    connector_of,
    prompt_crc,
    side_of,
    transfers,
)
from radixserve.core.interfaces import KVConnector, TransferEvent
from radixserve.core.plugins import Registration, Registry
from radixserve.core.request import FinishReason, InvalidRequest, Req, ReqState, SamplingParams
from radixserve.core.scheduler import Scheduler
from radixserve.core.tokenizer import Tokenizer

EOS = 0
TOKEN = 7
HOST, PORT = "prefill.test", 8998
PEER = (HOST, PORT)


class Recorder(KVConnector):
    """A connector that records each call and returns the events the test queues."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.events: list[TransferEvent] = []
        self.refusals: dict[int, str] = {}

    def start(self, role: str, kv_pool: Any, bootstrap_port: int, timeout: float) -> None:
        self.calls.append(("start", role, kv_pool, bootstrap_port, timeout, self.bootstrap_host))

    def send(self, room: int, kv_slots: torch.Tensor, meta: bytes) -> None:
        self.calls.append(("send", room, kv_slots.tolist(), msgspec.msgpack.decode(meta)))

    def receive(self, room: int, peer: tuple[str, int], kv_slots: torch.Tensor) -> None:
        self.calls.append(("receive", room, peer, kv_slots.tolist()))

    def cancel(self, room: int, reason: str, refused: bool = False) -> None:
        self.calls.append(("cancel", room, reason, refused))

    def poll(self) -> list[TransferEvent]:
        events, self.events = self.events, []
        return events

    def refuse(self, room: int, peer: tuple[str, int], reason: str) -> None:
        self.calls.append(("refuse", room, peer, reason))

    def refused(self, room: int) -> str | None:
        return self.refusals.get(room)

    def close(self) -> None:
        self.calls.append(("close",))

    def named(self, kind: str) -> list[tuple[Any, ...]]:
        return [c[1:] for c in self.calls if c[0] == kind]


def scheduler(tokenizer: Tokenizer, running: int = 4, pool: int = 256) -> Scheduler:
    return hand_scheduler(tokenizer, EOS, pool=pool, context=128, running=running)


def req(rid: str, n: int, room: int | None, max_new: int = 4, start: int = 10, **kw: Any) -> Req:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)
    r = Req(rid, list(range(start, start + n)), sampling)
    if room is not None:
        r.bootstrap = Bootstrap(host=HOST, port=PORT, room=room)
    return r


def step(sched: Scheduler, token: int = TOKEN, lp: float | None = None, top: Any = None) -> list:
    plan = sched.schedule()
    if plan is None:
        return []
    return sched.process_output(plan, {i: (token, lp, top) for i in sched.needs_sampling(plan)})


def in_use(sched: Scheduler) -> int:
    return sched.kv_accounting()["in_use"]


def prefill_side(tokenizer: Tokenizer) -> tuple[PrefillSide, Recorder, list[tuple[str, str]]]:
    """A PrefillSide on a real scheduler, as EngineCore wires it (its on_release hook)."""
    aborted: list[tuple[str, str]] = []
    sched = scheduler(tokenizer)
    conn = Recorder()

    def abort(rid: str, message: str) -> Req | None:
        aborted.append((rid, message))
        return sched.abort(rid, message)

    side = PrefillSide(conn, sched, abort)
    sched.strategies.append(side)
    return side, conn, aborted


def decode_side(tokenizer: Tokenizer, timeout: float = 60.0, running: int = 4) -> DecodeSide:
    return DecodeSide(Recorder(), scheduler(tokenizer, running), timeout)


def rec(side: PrefillSide | DecodeSide) -> Recorder:
    assert isinstance(side.connector, Recorder)
    return side.connector


# -- module functions -------------------------------------------------------------------------


def test_prompt_crc_is_the_crc32_of_the_ids_as_64_bit_integers() -> None:
    ids = [1, 2, 300, 70000]
    assert prompt_crc(ids) == zlib.crc32(array("q", ids).tobytes())
    assert prompt_crc([1, 2, 3]) == 734760327  # 24 bytes, not 12 (int32) or 3
    assert prompt_crc([1, 2, 3]) != prompt_crc([1, 2, 4])


def test_a_request_transfers_with_a_room_and_an_output_to_generate() -> None:
    assert transfers(req("a", 3, 1, max_new=1))
    assert not transfers(req("a", 3, 1, max_new=0))
    assert not transfers(req("a", 3, None, max_new=4))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_build_starts_the_configured_connector_for_its_side(mode: str) -> None:
    made: list[Recorder] = []

    def factory() -> Recorder:
        made.append(Recorder())
        return made[-1]

    registry = Registry("kv_transfer")
    registry.add(Registration("kv_transfer", "rec", factory, "test"))
    registry.add(Registration("kv_transfer", "other", lambda: None, "test"))
    config = SimpleNamespace(
        disaggregation_mode=mode,
        disaggregation_bootstrap_host=None,
        disaggregation_bootstrap_port=9123,
        disaggregation_transfer_timeout=12.5,
    )
    pool, sched = object(), object()
    core = SimpleNamespace(
        config=config,
        runner=SimpleNamespace(plugins=SimpleNamespace(names={"kv_transfer": "rec"}), kv_pool=pool),
        scheduler=sched,
        abort=lambda rid, message: None,
    )
    host = SimpleNamespace(registries={"kv_transfer": registry})
    side = build(core, host)
    assert type(side) is (PrefillSide if mode == "prefill" else DecodeSide)
    assert side.connector is made[0] and side.scheduler is sched
    assert made[0].calls == [("start", mode, pool, 9123, 12.5, "")]
    if isinstance(side, DecodeSide):
        assert side.timeout == 12.5
    else:
        assert side.abort_engine is core.abort
    config.disaggregation_bootstrap_host = "10.0.0.7"
    assert rec(build(core, host)).calls[0][-1] == "10.0.0.7"  # type: ignore[arg-type]
    config.disaggregation_mode = "null"
    assert build(core, host) is None
    assert len(made) == 2


def test_side_and_connector_of_a_core(tokenizer: Tokenizer) -> None:
    side = decode_side(tokenizer)
    other = SimpleNamespace()
    assert side_of(SimpleNamespace(strategies=[other, side])) is side
    assert connector_of(SimpleNamespace(strategies=[other, side])) is side.connector
    prefill, _, _ = prefill_side(tokenizer)
    assert side_of(SimpleNamespace(strategies=[prefill])) is prefill
    assert side_of(SimpleNamespace(strategies=[other])) is None
    assert connector_of(SimpleNamespace(strategies=[other])) is None


def test_close_closes_the_connector(tokenizer: Tokenizer) -> None:
    side = decode_side(tokenizer)
    side.close()
    assert rec(side).calls == [("close",)]


# -- the prefill side -------------------------------------------------------------------------


def test_prefill_cuts_a_transferring_request_to_its_first_token(tokenizer: Tokenizer) -> None:
    side, conn, _ = prefill_side(tokenizer)
    r = req("a", 5, 3, max_new=9, min_new_tokens=4)
    assert side.admit(r, False) is False  # it runs here as any request
    assert r.sampling.max_new_tokens == 1 and r.sampling.min_new_tokens == 1
    assert r.asked_max_new_tokens == 9 and r.sampling.temperature == 0.0
    assert side.live == {3: "a"}
    b = req("b", 5, 4, max_new=9)
    side.admit(b, True)
    assert b.sampling.min_new_tokens == 0 and side.live == {3: "a", 4: "b"}
    whole = req("w", 5, None, max_new=9)
    assert side.admit(whole, False) is False
    assert whole.sampling.max_new_tokens == 9 and whole.asked_max_new_tokens is None
    nothing = req("n", 5, 5, max_new=0)  # a room but nothing to generate: runs whole
    assert side.admit(nothing, False) is False
    assert nothing.bootstrap is None and 5 not in side.live
    assert side.has_work() is False and side.abort("a", "x") is None
    assert conn.calls == []


def test_prefill_refuses_a_room_in_use_or_refused_by_the_decode(tokenizer: Tokenizer) -> None:
    side, conn, _ = prefill_side(tokenizer)
    side.admit(req("a", 5, 3), False)
    with pytest.raises(InvalidRequest) as e:
        side.admit(req("b", 5, 3), False)
    assert str(e.value) == "bootstrap_room 3 is already in use on this server"
    conn.refusals[8] = "the decode server refused the request: too long"
    late = req("c", 5, 8, max_new=6)
    with pytest.raises(InvalidRequest) as e:
        side.admit(late, False)
    assert str(e.value) == "the decode server refused the request: too long"
    assert side.live == {3: "a"} and late.sampling.max_new_tokens == 6


def test_prefill_admits_a_compiled_request_to_its_scheduler(tokenizer: Tokenizer) -> None:
    side, _, _ = prefill_side(tokenizer)
    assert side.admit_compiled(req("w", 5, None)) is None
    r = req("a", 5, 3)
    assert side.admit_compiled(r) is False
    assert list(side.scheduler.waiting) == [r]


def test_prefill_cancel_room_tells_the_decode_unless_the_room_is_live(
    tokenizer: Tokenizer,
) -> None:
    side, conn, _ = prefill_side(tokenizer)
    side.cancel_room(5, "bad field", PEER)
    side.cancel_room(6, "overloaded", None, refused=False)
    side.admit(req("a", 5, 7), False)
    side.cancel_room(7, "bad field", PEER)  # a live request of that room: not this one's
    assert conn.named("cancel") == [
        (5, "the prefill server refused the request: bad field", True),
        (6, "the prefill server could not take the request: overloaded", False),
    ]
    side.refused(req("b", 5, 9), "its grammar does not compile")
    side.refused(req("c", 5, None), "whatever")
    assert conn.named("cancel")[-1] == (
        9,
        "the prefill server refused the request: its grammar does not compile",
        True,
    )
    assert len(conn.named("cancel")) == 3


def test_prefill_sends_the_prompt_kv_and_first_token_on_release(tokenizer: Tokenizer) -> None:
    side, conn, _ = prefill_side(tokenizer)
    sched = side.scheduler
    cached = req("warm", 6, None, max_new=1)  # puts 6 of the prompt's tokens in the cache
    sched.add_request(cached)
    step(sched)
    r = req("a", 9, 3, max_new=5, logprobs=True, top_logprobs_num=1)
    side.admit(r, False)
    sched.add_request(r)
    step(sched, lp=-0.25, top=[(-0.25, TOKEN)])
    assert r.finished and r.output_ids == [TOKEN]
    ((room, slots, meta),) = conn.named("send")
    assert room == 3 and len(slots) == 9 and len(set(slots)) == 9
    assert slots == sched.cache.match_prefix(r.input_ids)[0].tolist()
    assert meta == {
        "input_len": 9,
        "ids_crc": prompt_crc(r.input_ids),
        "token": TOKEN,
        "logprob": -0.25,
        "top": [[-0.25, TOKEN]],
        "cached_tokens": 6,
    }
    assert side.sent == {"a"}
    side.on_release(sched, r)  # released twice: sent once
    assert len(conn.named("send")) == 1
    side.ended([r])
    assert side.live == {} and side.sent == set() and conn.named("cancel") == []
    assert in_use(sched) == 0


def test_prefill_sends_no_logprobs_that_were_not_asked(tokenizer: Tokenizer) -> None:
    side, conn, _ = prefill_side(tokenizer)
    r = req("a", 4, 3)
    side.admit(r, False)
    side.scheduler.add_request(r)
    step(side.scheduler, lp=-0.5, top=[(-0.5, TOKEN)])
    ((_, _, meta),) = conn.named("send")
    assert meta["logprob"] is None and meta["top"] is None and meta["cached_tokens"] == 0


def test_prefill_sends_nothing_for_requests_it_does_not_transfer(tokenizer: Tokenizer) -> None:
    side, conn, _ = prefill_side(tokenizer)
    sched = side.scheduler
    whole = req("w", 4, None, max_new=1)
    unknown = req("u", 4, 11, max_new=1, start=50)  # a room, but never admitted by the side
    sched.add_request(whole)
    sched.add_request(unknown)
    step(sched)
    assert whole.finished and unknown.finished
    early = req("e", 20, 12, start=80)
    side.admit(early, False)
    sched.add_request(early)
    assert sched.abort("e", "client went away") is early  # released before any token
    assert conn.named("send") == []
    side.ended([whole, unknown, early])
    assert conn.named("cancel") == [
        (12, "the prefill server ended the request: client went away", False)
    ]
    assert side.live == {}


def test_prefill_ended_skips_unfinished_and_other_rids_and_tells_refusals(
    tokenizer: Tokenizer,
) -> None:
    side, conn, _ = prefill_side(tokenizer)
    r = req("a", 4, 3)
    side.admit(r, False)
    side.ended([r])  # not finished yet
    impostor = req("b", 4, 3)
    impostor.finish(FinishReason("abort", message="x"))
    side.ended([impostor])  # same room, another request
    assert side.live == {3: "a"} and conn.calls == []
    r.refused = True
    r.finish(FinishReason("abort", message="bad grammar"))
    side.ended([r])
    assert conn.named("cancel") == [
        (3, "the prefill server refused the request: bad grammar", True)
    ]
    s = req("s", 4, 4)
    side.admit(s, False)
    s.state = ReqState.FINISHED  # finished with no reason recorded
    side.ended([s])
    assert conn.named("cancel")[-1] == (4, "the prefill server ended the request: None", False)


def test_prefill_poll_aborts_requests_whose_decode_gave_up(tokenizer: Tokenizer) -> None:
    side, conn, aborted = prefill_side(tokenizer)
    sched = side.scheduler
    a, b, c = req("a", 20, 1), req("b", 20, 2, start=40), req("c", 4, 3, start=70)
    for r in (a, b, c):
        side.admit(r, False)
        sched.add_request(r)
    side.sent.add("b")  # as if its KV was already out
    conn.events = [
        TransferEvent(9, False, error="unknown room"),
        TransferEvent(3, True),
        TransferEvent(2, False, error="too late"),
        TransferEvent(1, False, error="client went away"),
    ]
    ended = side.poll()
    assert ended == [a] and a.state == ReqState.ABORTED
    assert aborted == [("a", "the decode server gave the request up: client went away")]
    assert a.finish_reason.message == aborted[0][1]
    aborted.clear()
    side.abort_engine = lambda rid, message: aborted.append((rid, message))  # finds nothing
    conn.events = [TransferEvent(3, False, error="gone")]
    assert side.poll() == [] and aborted == [("c", "the decode server gave the request up: gone")]


# -- the decode side --------------------------------------------------------------------------


def test_decode_holds_a_transferring_request_until_its_kv_arrives(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disaggregation.time, "monotonic", lambda: 1000.0)
    side = decode_side(tokenizer, timeout=7.5)
    assert side.admit(req("w", 4, None), False) is False
    assert side.admit(req("n", 4, 1, max_new=0), False) is False
    assert not side.has_work() and side.wait_timeout() is None
    r = req("a", 5, 3)
    r.logprob_start_len = 2
    assert side.admit(r, False) is True
    assert list(side.queue) == [r] and side.deadlines == {"a": 1007.5}
    assert r.logprob_start_len == -1  # prompt logprobs come with the prefill's response
    assert side.holds(3) and not side.holds(4) and side.has_work()
    with pytest.raises(InvalidRequest) as e:
        side.admit(req("b", 5, 3), False)
    assert str(e.value) == "bootstrap_room 3 is already in use on this server"
    compiling = req("g", 5, 6)
    assert side.admit(compiling, True) is True  # checked, not yet queued
    assert not side.holds(6) and "g" not in side.deadlines
    with pytest.raises(InvalidRequest):
        side.admit(req("c", 5, 3), True)
    assert side.admit_compiled(req("x", 5, None)) is None
    assert side.admit_compiled(compiling) is False and side.holds(6)
    taken = req("t", 5, 6)
    assert side.admit_compiled(taken) is True
    assert taken.state == ReqState.ABORTED
    assert taken.finish_reason == FinishReason(
        "abort", message="bootstrap_room 6 is already in use on this server"
    )
    assert [q.rid for q in side.queue] == ["a", "g"]


def test_decode_wait_timeout_is_the_nearest_deadline_capped(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(disaggregation.time, "monotonic", lambda: now[0])
    side = decode_side(tokenizer, timeout=60.0)
    side.admit(req("a", 5, 3), False)
    assert side.wait_timeout() == MAX_IDLE_WAIT_S == 0.5
    side.deadlines["a"] = 1000.25
    side.deadlines["b"] = 1000.125
    assert side.wait_timeout() == 0.125
    now[0] = 1001.0
    assert side.wait_timeout() == 0.0
    side.deadlines.clear()  # work, but nothing with a deadline
    assert side.wait_timeout() == 0.5


def test_decode_reserves_slots_and_asks_for_the_kv(tokenizer: Tokenizer) -> None:
    side = decode_side(tokenizer, running=2)
    conn = rec(side)
    a, b, c = req("a", 5, 3), req("b", 4, 4, start=30), req("c", 4, 5, start=50)
    for r in (a, b, c):
        side.admit(r, False)
    assert side.poll() == []
    receives = conn.named("receive")
    assert [(room, peer, len(slots)) for room, peer, slots in receives] == [
        (3, PEER, 5),
        (4, PEER, 4),
    ]  # the running limit (2) counts the reserved ones
    table = side.scheduler.req_to_token.table
    assert receives[0][2] == table[a.req_pool_idx, :5].tolist()
    assert set(side.transfers) == {3, 4} and list(side.queue) == [c]
    assert side.holds(4) and side.holds(5) and c.req_pool_idx is None
    assert in_use(side.scheduler) == 9


def test_decode_starts_decoding_when_the_kv_arrives(tokenizer: Tokenizer) -> None:
    side = decode_side(tokenizer)
    sched = side.scheduler
    r = req("a", 6, 3, max_new=3, logprobs=True, top_logprobs_num=1)
    side.admit(r, False)
    side.poll()
    meta = TransferMeta(input_len=6, ids_crc=prompt_crc(r.input_ids), token=TOKEN,
                        logprob=-0.5, top=[(-0.5, TOKEN)], cached_tokens=4)  # fmt: skip
    rec(side).events = [TransferEvent(3, True, meta=msgspec.msgpack.encode(meta))]
    assert side.poll() == [r]
    assert r.state == ReqState.DECODE and r.kv_len == 6 and r.cached_tokens == 4
    assert r.output_ids == [TOKEN] and r.output_logprobs == [-0.5]
    assert r.output_top_logprobs == [[(-0.5, TOKEN)]]
    assert sched.running == [r] and side.transfers == {} and side.deadlines == {}
    assert not side.has_work()
    for _ in range(2):
        step(sched)
    assert r.finished and r.output_ids == [TOKEN] * 3
    assert in_use(sched) == 0 and rec(side).named("cancel") == []


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        (b"\x01\x02", "the prefill server sent an unreadable message: "),
        (
            TransferMeta(input_len=5, ids_crc=0, token=TOKEN),
            "the prefill server's prompt (5 tokens) differs from this server's (6 tokens): the "
            "two servers must serve the same model and tokenizer",
        ),
        (
            TransferMeta(input_len=6, ids_crc=1, token=TOKEN),
            "the prefill server's prompt (6 tokens) differs from this server's (6 tokens)",
        ),
    ],
)
def test_decode_fails_a_request_whose_kv_does_not_match(
    tokenizer: Tokenizer, meta: Any, problem: str
) -> None:
    side = decode_side(tokenizer)
    r = req("a", 6, 3)
    if isinstance(meta, TransferMeta) and meta.ids_crc == 0:
        meta.ids_crc = prompt_crc(r.input_ids)  # right prompt, wrong length
    raw = meta if isinstance(meta, bytes) else msgspec.msgpack.encode(meta)
    side.admit(r, False)
    side.poll()
    rec(side).events = [TransferEvent(3, True, meta=raw)]
    assert side.poll() == [r]
    assert r.state == ReqState.ABORTED and r.failed is not None and r.failed.startswith(problem)
    assert r.finish_reason.message == r.failed and not r.refused
    assert r.output_ids == [] and r.req_pool_idx is None
    assert in_use(side.scheduler) == 0 and side.scheduler.running == []


def test_decode_ends_failed_and_refused_transfers(tokenizer: Tokenizer) -> None:
    side = decode_side(tokenizer)
    a, b = req("a", 5, 3), req("b", 5, 4, start=30)
    side.admit(a, False)
    side.admit(b, False)
    side.poll()
    rec(side).events = [
        TransferEvent(9, False, error="not ours"),
        TransferEvent(3, False, error="connection reset"),
        TransferEvent(4, False, error="the prefill server refused the request: bad", refused=True),
    ]
    assert side.poll() == [a, b]
    assert a.failed == "KV transfer from the prefill server failed: connection reset"
    assert a.finish_reason.message == a.failed and not a.refused
    assert b.refused and b.failed is None
    assert b.finish_reason == FinishReason(
        "abort", message="the prefill server refused the request: bad"
    )
    assert side.transfers == {} and side.deadlines == {} and in_use(side.scheduler) == 0
    assert a.req_pool_idx is None and b.req_pool_idx is None


def test_decode_abort_frees_a_waiting_request_and_tells_the_prefill(
    tokenizer: Tokenizer,
) -> None:
    side = decode_side(tokenizer, running=1)
    conn = rec(side)
    a, b = req("a", 5, 3), req("b", 5, 4, start=30)
    side.admit(a, False)
    side.admit(b, False)
    side.poll()  # a waits for its KV, b for slots
    assert in_use(side.scheduler) == 5
    assert side.abort("zzz", "x") is None
    assert side.abort("b", "client went away") is b
    assert b.finish_reason == FinishReason("abort", message="client went away")
    assert list(side.queue) == [] and "b" not in side.deadlines and conn.named("cancel") == []
    assert side.abort("a", "client left") is a
    assert a.state == ReqState.ABORTED and a.req_pool_idx is None
    assert conn.named("cancel") == [(3, "client left", False)]
    assert side.transfers == {} and side.deadlines == {} and in_use(side.scheduler) == 0
    assert a.failed is None and not a.refused


def test_decode_times_out_rooms_whose_kv_or_slots_do_not_come(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr(disaggregation.time, "monotonic", lambda: now[0])
    side = decode_side(tokenizer, timeout=2.5, running=1)
    conn = rec(side)
    a, b, c = req("a", 5, 3), req("b", 5, 4, start=30), req("c", 5, 5, start=50)
    for r in (a, b):
        side.admit(r, False)
    now[0] = 1001.0
    side.admit(c, False)
    side.poll()  # a waits for its KV; b, c for slots
    now[0] = 1002.5  # a's and b's deadlines, exactly
    with caplog.at_level(logging.WARNING, logger="radixserve.core.disaggregation"):
        ended = side.poll()
    assert ended == [a, b]
    assert a.failed == (
        f"timed out after 2.5 s waiting for its KV from the prefill server {HOST}:{PORT} (room 3)"
    )
    assert b.failed == "timed out after 2.5 s waiting for free KV slots"
    assert conn.named("cancel") == [(3, "the decode server waited 2.5 s", False)]
    assert [r.getMessage() for r in caplog.records] == [
        f"request {r.rid}: {r.failed}" for r in (a, b)
    ]
    # c got the slots a gave back, and keeps its own deadline
    assert list(side.transfers) == [5] and side.deadlines == {"c": 1003.5}
    assert in_use(side.scheduler) == 5 and a.req_pool_idx is None


def test_decode_refuses_rooms_it_does_not_hold(tokenizer: Tokenizer) -> None:
    side = decode_side(tokenizer)
    conn = rec(side)
    side.admit(req("a", 5, 3), False)
    side.cancel_room(3, "x", PEER)  # its own live request's room
    side.cancel_room(4, "x", None)  # no peer to tell
    side.cancel_room(5, "too long", PEER)
    assert conn.named("refuse") == [(5, PEER, "the decode server refused the request: too long")]
    side.refused(req("b", 5, 6), "bad")
    side.refused(req("c", 5, None), "bad")
    assert conn.named("refuse")[-1] == (6, PEER, "the decode server refused the request: bad")
    d, e, f = req("d", 5, 7), req("e", 5, 8), req("f", 5, 9)
    d.finish(FinishReason("abort", message="grammar failed"))
    e.finish(FinishReason("abort"))
    side.ended_unscheduled([d, e, f, req("g", 5, None)])
    assert conn.named("refuse")[-2:] == [
        (7, PEER, "the decode server refused the request: grammar failed"),
        (8, PEER, "the decode server refused the request: abort"),
    ]
    assert len(conn.named("refuse")) == 4


def test_transfers_meta_round_trips_with_its_defaults() -> None:
    meta = msgspec.msgpack.decode(msgspec.msgpack.encode(TransferMeta(input_len=3, ids_crc=5,
                                                                      token=1)))  # fmt: skip
    assert meta == {"input_len": 3, "ids_crc": 5, "token": 1, "logprob": None, "top": None,
                    "cached_tokens": 0}  # fmt: skip


def test_prefill_ended_goes_through_every_request_of_the_step(tokenizer: Tokenizer) -> None:
    side, conn, _ = prefill_side(tokenizer)
    sent, told = req("s", 4, 1), req("t", 4, 2)
    for r in (sent, told):
        side.admit(r, False)
        r.finish(FinishReason("abort", message="done"))
    side.sent.add("s")  # its KV went out: nothing to tell
    side.ended([sent, told])
    assert side.live == {} and side.sent == set()
    assert conn.named("cancel") == [(2, "the prefill server ended the request: done", False)]
