"""Prefill/decode disaggregation: the request states around a KV transfer.

A router (sglang-router in PD mode) sends one request to a prefill engine and a decode engine
with the same ``bootstrap_room``. The prefill computes the prompt and the first token like any
request, its output budget cut to one token, and when the request ends hands the prompt's KV
slots and a ``TransferMeta`` (the first token and its logprobs) to its KV connector, which
delivers them to the decode that asks for the room. The decode preallocates slots for the
prompt ("waiting for KV"), has the connector fill them, then appends the first token and lets
the request decode like any other. Either side ending the request early reaches the other
through the connector (``KVConnector.cancel``); a room whose KV does not arrive in time ends
with an error and its slots are freed.

Requests without a room (health checks, clients that bypass the router) run whole on either
server. Connectors move bytes; everything about requests and slots is here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from array import array
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from radixserve.core.interfaces import StepStrategy
from radixserve.core.request import FinishReason, InvalidRequest, Req, ReqState

if TYPE_CHECKING:  # the server process imports Bootstrap (entrypoints/ipc.py) without torch
    from radixserve.core.interfaces import KVConnector
    from radixserve.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's, used when the router sends bootstrap_port null
# Longest the engine sleeps while it only waits for transfers (deadlines are checked on wake).
MAX_IDLE_WAIT_S = 0.5


class Bootstrap(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decode fetches a request's KV: the prefill's bootstrap server and the room."""

    host: str
    port: int
    room: int


class TransferMeta(msgspec.Struct, kw_only=True):
    """The metadata message that travels with the KV, prefill -> decode."""

    input_len: int
    ids_crc: int  # of the prompt's token ids: both servers must have tokenized alike
    token: int  # the first output token, sampled by the prefill
    logprob: float | None = None
    top: list[tuple[float, int]] | None = None
    cached_tokens: int = 0  # prompt tokens the prefill found in its cache


_meta_decoder = msgspec.msgpack.Decoder(TransferMeta)


def prompt_crc(ids: list[int]) -> int:
    return zlib.crc32(array("q", ids).tobytes())


def transfers(req: Req) -> bool:
    """Whether ``req`` takes part in a transfer (a room, and an output to generate)."""
    return req.bootstrap is not None and req.sampling.max_new_tokens > 0


def build(core: Any, host: Any) -> PrefillSide | DecodeSide | None:
    """The prefill or decode side of ``core``'s disaggregation mode, with its started KV
    connector; None when the mode is "null"."""
    config = core.config
    if config.disaggregation_mode == "null":
        return None
    name = core.runner.plugins.names["kv_transfer"]
    connector = host.registries["kv_transfer"].get(name).factory()
    connector.bootstrap_host = config.disaggregation_bootstrap_host or ""
    connector.start(
        config.disaggregation_mode,
        core.runner.kv_pool,
        config.disaggregation_bootstrap_port,
        config.disaggregation_transfer_timeout,
    )
    if config.disaggregation_mode == "prefill":
        return PrefillSide(connector, core.scheduler, core.abort)
    return DecodeSide(connector, core.scheduler, config.disaggregation_transfer_timeout)


def side_of(core: Any) -> PrefillSide | DecodeSide | None:
    """An EngineCore's disaggregation side (None when it serves whole requests)."""
    return next((s for s in core.strategies if isinstance(s, (PrefillSide, DecodeSide))), None)


def connector_of(core: Any) -> KVConnector | None:
    """The KV connector of an EngineCore's disaggregation side (None when it has none)."""
    side = side_of(core)
    return side.connector if side is not None else None


class _Side(StepStrategy):
    """What both sides do at the step's fixed points (core/interfaces.py, StepStrategy)."""

    connector: KVConnector

    def _transfers(self, req: Req) -> bool:
        """Whether ``req`` takes part in a transfer; one with a room but nothing to generate
        runs whole here (its room is dropped)."""
        if req.bootstrap is not None and not transfers(req):
            req.bootstrap = None
        return req.bootstrap is not None

    def refused(self, req: Any, message: str) -> None:
        b = req.bootstrap
        if b is not None:
            self.cancel_room(b.room, message, (b.host, b.port))

    def cancel_room(
        self, room: int, message: str, peer: tuple[str, int] | None, refused: bool = True
    ) -> None:
        """See EngineCore.cancel_room."""

    def close(self) -> None:
        self.connector.close()


class PrefillSide(_Side):
    """The prefill engine's part: cut requests to their first token, send their KV on end."""

    def __init__(
        self, connector: KVConnector, scheduler: Scheduler, abort: Callable[[str, str], object]
    ) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.abort_engine = abort
        self.live: dict[int, str] = {}  # room -> rid of requests not yet ended here
        self.sent: set[str] = set()

    def admit(self, req: Any, compiling: bool) -> bool:
        if self._transfers(req):
            self.add(req)
        return False  # it runs here as any request (after its grammar compiled)

    def admit_compiled(self, req: Any) -> bool | None:
        """No jump-forward before the first token, which the prefill samples under the
        grammar (it sends the KV of the prompt alone)."""
        if req.bootstrap is None:
            return None
        self.scheduler.add_request(req)
        return False

    def cancel_room(
        self, room: int, message: str, peer: tuple[str, int] | None, refused: bool = True
    ) -> None:
        if room in self.live:
            return
        if refused:
            reason = f"the prefill server refused the request: {message}"
        else:
            reason = f"the prefill server could not take the request: {message}"
        self.connector.cancel(room, reason, refused=refused)

    def add(self, req: Req) -> None:
        room = req.bootstrap.room
        if room in self.live:
            raise InvalidRequest(f"bootstrap_room {room} is already in use on this server")
        refused = self.connector.refused(room)
        if refused is not None:  # the decode refused its copy first: no one will fetch the KV
            raise InvalidRequest(refused)
        # The decode server generates the rest; here only the first token is sampled.
        s = req.sampling
        req.asked_max_new_tokens = s.max_new_tokens  # the grammar's budget check reads it
        req.sampling = dataclasses.replace(
            s, max_new_tokens=1, min_new_tokens=min(1, s.min_new_tokens)
        )
        self.live[room] = req.rid

    def abort(self, rid: str, message: str) -> Req | None:
        return None  # prefill requests live in the scheduler

    def has_work(self) -> bool:
        return False  # the connector's own threads serve the decode servers

    def on_release(self, scheduler: Any, req: Any) -> None:
        """The scheduler lets go of ``req``'s slots next: send them now if its first token is
        out (the slots may go to other requests after this returns)."""
        if req.bootstrap is None or not req.output_ids or req.rid in self.sent:
            return
        if self.live.get(req.bootstrap.room) != req.rid:
            return
        assert req.req_pool_idx is not None
        n = len(req.input_ids)
        meta = TransferMeta(
            input_len=n,
            ids_crc=prompt_crc(req.input_ids),
            token=req.output_ids[0],
            logprob=req.output_logprobs[0] if req.output_logprobs else None,
            top=req.output_top_logprobs[0] if req.output_top_logprobs else None,
            cached_tokens=req.cached_tokens,
        )
        slots = self.scheduler.req_to_token.table[req.req_pool_idx, :n]
        self.connector.send(req.bootstrap.room, slots, msgspec.msgpack.encode(meta))
        self.sent.add(req.rid)

    def poll(self) -> list[Req]:
        """Abort the requests whose decode gave up on them."""
        ended: list[Req] = []
        for event in self.connector.poll():
            rid = self.live.get(event.room)
            if rid is None or event.ok or rid in self.sent:
                continue
            req = self.abort_engine(rid, f"the decode server gave the request up: {event.error}")
            if isinstance(req, Req):
                ended.append(req)
        return ended

    def ended(self, reqs: list[Req]) -> None:
        """Forget ended requests; tell the decode about those whose KV was never sent."""
        for req in reqs:
            if not req.finished or req.bootstrap is None:
                continue
            room = req.bootstrap.room
            if self.live.get(room) != req.rid:
                continue
            del self.live[room]
            if req.rid in self.sent:
                self.sent.discard(req.rid)
                continue
            why = req.finish_reason.message if req.finish_reason is not None else None
            if req.refused:  # a client error (e.g. its grammar): the decode answers 400 too
                self.connector.cancel(room, f"the prefill server refused the request: {why}", True)
            else:
                self.connector.cancel(room, f"the prefill server ended the request: {why}")


class DecodeSide(_Side):
    """The decode engine's part: preallocate, wait for KV, then decode."""

    def __init__(self, connector: KVConnector, scheduler: Scheduler, timeout: float) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.timeout = timeout
        self.queue: deque[Req] = deque()  # waiting for slots
        self.transfers: dict[int, Req] = {}  # room -> request waiting for its KV
        self.deadlines: dict[str, float] = {}  # rid -> when its KV must have arrived

    def check(self, req: Req) -> None:
        """Refuse ``req`` if its room is in use here (a request with a grammar is checked on
        arrival and added once its grammar has compiled)."""
        if self.holds(req.bootstrap.room):
            raise InvalidRequest(
                f"bootstrap_room {req.bootstrap.room} is already in use on this server"
            )

    def admit(self, req: Any, compiling: bool) -> bool:
        """Held here until its KV arrived; one with a grammar is checked now and added once
        its grammar compiled."""
        if not self._transfers(req):
            return False
        if compiling:
            self.check(req)
        else:
            self.add(req)
        return True

    def admit_compiled(self, req: Any) -> bool | None:
        """Starts waiting for its KV; True when it ended instead (its room got taken
        meanwhile)."""
        if req.bootstrap is None:
            return None
        try:
            self.add(req)
        except InvalidRequest as e:
            req.finish(FinishReason("abort", message=str(e)))
            return True
        return False

    def ended_unscheduled(self, reqs: list[Any]) -> None:
        """The prefill need not keep their KV."""
        for req in reqs:
            b, why = req.bootstrap, req.finish_reason
            if b is not None and why is not None:
                self.cancel_room(b.room, why.message or why.type, (b.host, b.port))

    def cancel_room(
        self, room: int, message: str, peer: tuple[str, int] | None, refused: bool = True
    ) -> None:
        if peer is not None and not self.holds(room):
            reason = f"the decode server refused the request: {message}"
            self.connector.refuse(room, peer, reason)

    def add(self, req: Req) -> None:
        self.check(req)
        # Prompt logprobs come with the prefill's response (the router merges them).
        req.logprob_start_len = -1
        self.deadlines[req.rid] = time.monotonic() + self.timeout
        self.queue.append(req)

    def holds(self, room: int) -> bool:
        """Whether a request of ``room`` waits here (for slots or for its KV)."""
        return room in self.transfers or any(r.bootstrap.room == room for r in self.queue)

    def has_work(self) -> bool:
        return bool(self.queue or self.transfers)

    def wait_timeout(self) -> float | None:
        """Seconds the engine may sleep before a deadline needs checking (None: nothing
        waits here)."""
        if not self.has_work():
            return None
        if not self.deadlines:
            return MAX_IDLE_WAIT_S
        left = min(self.deadlines.values()) - time.monotonic()
        return min(MAX_IDLE_WAIT_S, max(left, 0.0))

    def poll(self) -> list[Req]:
        """Take in finished transfers, end failed and late ones, start new ones. Returns the
        requests that ended (or got their first token)."""
        changed = self._poll()
        changed += self._expire()
        self._allocate()
        return changed

    def abort(self, rid: str, message: str) -> Req | None:
        req = next((r for r in self.queue if r.rid == rid), None)
        if req is not None:
            self.queue.remove(req)
        else:
            req = next((r for r in self.transfers.values() if r.rid == rid), None)
            if req is None:
                return None
            del self.transfers[req.bootstrap.room]
            self.connector.cancel(req.bootstrap.room, message)
            self._free(req)
        self.deadlines.pop(rid, None)
        req.finish(FinishReason("abort", message=message))
        return req

    # -- internals -------------------------------------------------------------------------

    def _poll(self) -> list[Req]:
        changed: list[Req] = []
        for event in self.connector.poll():
            req = self.transfers.pop(event.room, None)
            if req is None:
                continue
            self.deadlines.pop(req.rid, None)
            if event.refused:  # the prefill refused its copy: the client's error, not ours
                self._fail(req, event.error, refused=True)
            elif not event.ok:
                self._fail(req, f"KV transfer from the prefill server failed: {event.error}")
            else:
                problem = self._start_decoding(req, event.meta)
                if problem is not None:
                    self._fail(req, problem)
            changed.append(req)
        return changed

    def _start_decoding(self, req: Req, raw: bytes) -> str | None:
        try:
            meta = _meta_decoder.decode(raw)
        except msgspec.DecodeError as e:
            return f"the prefill server sent an unreadable message: {e}"
        n = len(req.input_ids)
        if meta.input_len != n or meta.ids_crc != prompt_crc(req.input_ids):
            return (
                f"the prefill server's prompt ({meta.input_len} tokens) differs from this "
                f"server's ({n} tokens): the two servers must serve the same model and tokenizer"
            )
        req.kv_len = n
        req.cached_tokens = meta.cached_tokens
        req.state = ReqState.DECODE
        # the prefill sampled it under the grammar; here the matcher takes it (and may jump
        # forward: the request then extends over the forced tokens first)
        self.scheduler.append_received(req, meta.token, meta.logprob, meta.top)
        self.scheduler.add_running(req)
        return None

    def _expire(self) -> list[Req]:
        now = time.monotonic()
        late = [rid for rid, deadline in self.deadlines.items() if deadline <= now]
        ended: list[Req] = []
        for rid in late:
            del self.deadlines[rid]
            req = next((r for r in self.queue if r.rid == rid), None)
            if req is not None:
                self.queue.remove(req)
                where = "free KV slots"
            else:
                req = next(r for r in self.transfers.values() if r.rid == rid)
                del self.transfers[req.bootstrap.room]
                b = req.bootstrap
                where = f"its KV from the prefill server {b.host}:{b.port} (room {b.room})"
                self.connector.cancel(b.room, f"the decode server waited {self.timeout:g} s")
            self._fail(req, f"timed out after {self.timeout:g} s waiting for {where}")
            ended.append(req)
        return ended

    def _allocate(self) -> None:
        """Reserve the prompt's slots (whole pages) for queued requests, while the running
        limit and the KV pool allow, and start their transfers."""
        while self.queue:
            req = self.queue[0]
            slots = self.scheduler.reserve_prompt(req, len(self.transfers))
            if slots is None:
                return
            self.queue.popleft()
            b = req.bootstrap
            self.transfers[b.room] = req
            self.connector.receive(b.room, (b.host, b.port), slots)

    def _free(self, req: Req) -> None:
        """Give back a waiting request's reserved slots and table row."""
        self.scheduler.free_reserved(req)

    def _fail(self, req: Req, message: str, refused: bool = False) -> None:
        """End ``req``: refused (the server answers 400) or failed (500)."""
        logger.warning("request %s: %s", req.rid, message)
        self._free(req)
        if refused:
            req.refused = True
        else:
            req.failed = message
        req.finish(FinishReason("abort", message=message))
