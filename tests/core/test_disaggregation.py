"""core/disaggregation.py in process: a prefill EngineCore and a decode EngineCore joined by an
in-memory connector (the KVConnector contract, without sockets). Greedy outputs equal one
colocated core's, also when the two sides page their pools differently; a decode that gives up
aborts the prefill mid-prompt; a prefill that ends without sending fails the decode; a late room
frees its slots; the KV accounting holds on both sides after each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from platform_choice import on_cpu

from radixserve.core.config import EngineConfig
from radixserve.core.disaggregation import Bootstrap, DecodeSide, PrefillSide
from radixserve.core.engine_core import EngineCore
from radixserve.core.interfaces import KVConnector, TransferEvent
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, ReqState, SamplingParams

PEER = ("prefill.test", 8998)


class Wire:
    """What the two in-memory connectors share: KV sent per room, rooms given up."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[list[torch.Tensor], bytes]] = {}
        self.gone: dict[int, tuple[str, bool]] = {}  # room -> (why, refused)
        self.decode_gave_up: list[int] = []


class MemoryConnector(KVConnector):
    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.pool: Any = None
        self.role = ""
        self.waiting: dict[int, torch.Tensor] = {}

    def start(self, role: str, kv_pool: Any, bootstrap_port: int, timeout: float) -> None:
        self.role, self.pool = role, kv_pool

    def send(self, room: int, kv_slots: torch.Tensor, meta: bytes) -> None:
        rows = [t[kv_slots].clone() for layer in range(len(self.pool.k))
                for t in (self.pool.k[layer], self.pool.v[layer])]  # fmt: skip
        self.wire.sent[room] = (rows, meta)

    def receive(self, room: int, peer: tuple[str, int], kv_slots: torch.Tensor) -> None:
        assert peer == PEER
        self.waiting[room] = kv_slots

    def cancel(self, room: int, reason: str, refused: bool = False) -> None:
        if self.role == "decode":
            self.waiting.pop(room, None)
            self.wire.decode_gave_up.append(room)
        else:
            self.wire.gone[room] = (reason, refused)

    def poll(self) -> list[TransferEvent]:
        if self.role == "prefill":
            gave_up, self.wire.decode_gave_up = self.wire.decode_gave_up, []
            return [TransferEvent(room, False, error="decode gave up") for room in gave_up]
        events = []
        for room, slots in list(self.waiting.items()):
            if room in self.wire.gone:
                reason, refused = self.wire.gone[room]
                events.append(TransferEvent(room, False, error=reason, refused=refused))
            elif room in self.wire.sent:
                rows, meta = self.wire.sent.pop(room)
                buffers = [t for layer in range(len(self.pool.k))
                           for t in (self.pool.k[layer], self.pool.v[layer])]  # fmt: skip
                for buf, data in zip(buffers, rows, strict=True):
                    buf[slots] = data
                events.append(TransferEvent(room, True, meta=meta))
            else:
                continue
            del self.waiting[room]
        return events


def make_core(model_dir: Path, **kw: Any) -> EngineCore:
    defaults: dict[str, Any] = {"max_total_tokens": 512, "chunked_prefill_size": 16}
    return EngineCore(model_dir, EngineConfig(**on_cpu({**defaults, **kw})), default_host())


def make_pair(
    model_dir: Path, decode_page: int = 1, timeout: float = 60.0, overlap: bool = False
) -> tuple[EngineCore, EngineCore, Wire]:
    wire = Wire()
    prefill = make_core(model_dir, enable_overlap_schedule=overlap)
    decode = make_core(model_dir, page_size=decode_page, enable_overlap_schedule=overlap)
    pc, dc = MemoryConnector(wire), MemoryConnector(wire)
    pc.start("prefill", prefill.runner.kv_pool, 0, timeout)
    dc.start("decode", decode.runner.kv_pool, 0, timeout)
    prefill.strategies.append(PrefillSide(pc, prefill.scheduler, prefill.abort))
    decode.strategies.append(DecodeSide(dc, decode.scheduler, timeout))
    return prefill, decode, wire


def req(rid: str, ids: list[int], room: int | None, max_new: int = 8) -> Req:
    r = Req(rid, list(ids), SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                          ignore_eos=True))  # fmt: skip
    if room is not None:
        r.bootstrap = Bootstrap(host=PEER[0], port=PEER[1], room=room)
    return r


def drive(*cores: EngineCore, limit: int = 500) -> None:
    for _ in range(limit):
        if not any(c.has_work() for c in cores):
            return
        for c in cores:
            if c.has_work():
                c.step()
    raise AssertionError("the cores did not finish")


def assert_no_leak(*cores: EngineCore) -> None:
    for core in cores:
        acct = core.scheduler.kv_accounting()
        assert acct["in_use"] == 0 and acct["locked"] == 0, acct


PROMPTS = [[5 + (i * 7 + j) % 300 for j in range(10 + 9 * i)] for i in range(6)]
PROMPTS += [PROMPTS[5][:40] + [17, 18, 19]]  # shares a prefix with the longest


@pytest.fixture(scope="module")
def colocated(tiny_llama_dir: Path) -> list[list[int]]:
    """Each prompt's greedy output on one colocated core."""
    core = make_core(tiny_llama_dir)
    reqs = [req(f"c{i}", ids, None) for i, ids in enumerate(PROMPTS)]
    for r in reqs:
        core.add_request(r)
    drive(core)
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize(("decode_page", "overlap"), [(1, False), (16, False), (1, True)])
def test_outputs_equal_colocated(
    tiny_llama_dir: Path, colocated: list[list[int]], decode_page: int, overlap: bool
) -> None:
    """Also with overlap scheduling (the GPU default): transferred requests join the running
    batch while a step is in flight."""
    prefill, decode, _ = make_pair(tiny_llama_dir, decode_page, overlap=overlap)
    pairs = [(req(f"p{i}", ids, 100 + i), req(f"d{i}", ids, 100 + i))
             for i, ids in enumerate(PROMPTS)]  # fmt: skip
    for p, d in pairs:
        decode.add_request(d)
        prefill.add_request(p)
    drive(prefill, decode)
    for (p, d), want in zip(pairs, colocated, strict=True):
        assert p.output_ids == want[:1]  # the prefill samples the first token only
        assert d.output_ids == want, d.rid
        assert d.state == ReqState.FINISHED
    assert_no_leak(prefill, decode)


def test_decode_giving_up_aborts_the_prefill(tiny_llama_dir: Path) -> None:
    prefill, decode, _ = make_pair(tiny_llama_dir)
    long_prompt = PROMPTS[5]  # several 16-token chunks
    p, d = req("p", long_prompt, 7), req("d", long_prompt, 7)
    prefill.add_request(p)
    decode.add_request(d)
    prefill.step()
    decode.step()  # preallocates and asks for room 7
    assert p.state == ReqState.PREFILL and d.req_pool_idx is not None
    assert decode.abort("d", "client went away") is d
    changed = prefill.step()
    assert p in changed and p.state == ReqState.ABORTED
    assert "decode server gave the request up" in (p.finish_reason.message or "")
    drive(prefill, decode)
    assert_no_leak(prefill, decode)


def test_prefill_ending_without_sending_fails_the_decode(tiny_llama_dir: Path) -> None:
    prefill, decode, _ = make_pair(tiny_llama_dir)
    p, d = req("p", PROMPTS[2], 9), req("d", PROMPTS[2], 9)
    decode.add_request(d)
    decode.step()
    prefill.add_request(p)
    prefill.abort("p", "client went away")
    changed = decode.step()
    assert d in changed and d.state == ReqState.ABORTED
    assert d.failed is not None and "client went away" in d.failed
    assert_no_leak(prefill, decode)


@pytest.mark.parametrize("client_error", [True, False])
def test_prefill_refusal_ends_the_decode_as_the_callers_fault_or_not(
    tiny_llama_dir: Path, client_error: bool
) -> None:
    """A call the prefill server refused before queueing it: the decode's request ends at once,
    refused (a 400) when the call was at fault, failed (a 500, which sglang-router retries on
    another prefill) when the prefill could not take it, e.g. overloaded."""
    prefill, decode, _ = make_pair(tiny_llama_dir)
    d = req("d", PROMPTS[2], 13)
    decode.add_request(d)
    decode.step()  # preallocates and asks for room 13
    prefill.cancel_room(13, "overloaded" if not client_error else "bad field", refused=client_error)
    changed = decode.step()
    assert d in changed and d.state == ReqState.ABORTED
    assert d.refused is client_error
    assert (d.failed is None) is client_error
    assert_no_leak(prefill, decode)


def test_late_room_frees_its_slots(tiny_llama_dir: Path) -> None:
    _, decode, _ = make_pair(tiny_llama_dir)
    disagg = decode.strategies[-1]
    assert isinstance(disagg, DecodeSide)
    d = req("d", PROMPTS[3], 11)
    decode.add_request(d)
    decode.step()  # preallocates and asks for room 11
    assert d.req_pool_idx is not None
    disagg.deadlines["d"] = 0.0  # its deadline has passed
    changed = decode.step()
    assert d in changed and d.state == ReqState.ABORTED
    assert "waiting for its KV from the prefill server prefill.test:8998" in (d.failed or "")
    assert disagg.connector.waiting == {}  # the room was given up
    assert_no_leak(decode)


def test_room_waiting_for_slots_times_out(tiny_llama_dir: Path) -> None:
    _, decode, _ = make_pair(tiny_llama_dir, timeout=1e-9)  # every deadline passes at once
    d = req("d", PROMPTS[3], 12)
    decode.add_request(d)
    changed = decode.step()
    assert d in changed and "waiting for free KV slots" in (d.failed or "")
    assert_no_leak(decode)


def test_requests_without_a_room_run_whole(tiny_llama_dir: Path) -> None:
    prefill, decode, _ = make_pair(tiny_llama_dir)
    a, b = req("a", PROMPTS[1], None), req("b", PROMPTS[1], None)
    prefill.add_request(a)
    decode.add_request(b)
    drive(prefill, decode)
    assert len(a.output_ids) == len(b.output_ids) == 8 and a.output_ids == b.output_ids
    assert_no_leak(prefill, decode)
