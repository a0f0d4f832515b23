"""Sessions that keep their KV between turns (SGLang's ``/open_session``, ``session_params``).

An agent sends the same growing context turn after turn. A session remembers the context of
its requests (prompt + output), and pins the newest one's KV in the radix cache (a lock ref)
so that other traffic cannot evict it before the next turn; the pin moves to each newer turn
and is dropped when the session closes, expires or is demoted.

Pins are bounded: together they hold at most ``pin_ratio`` of the KV pool (the rest of the
traffic is never starved). A pin that would pass the bound first drops the pins of the
sessions pinned longest ago; one larger than the whole bound is not taken. A dropped pin only
makes that prefix evictable again (once a host tier exists, that is where it would go).

``SessionParams`` on a request (see ``SessionTable.prepare``):
- ``id``: an open session (an unknown one is refused, naming it);
- ``rid``: the session's request to continue from (default: its newest; the session
  remembers its newest ``KEPT_REQUESTS``);
- ``offset``: keep only that many leading tokens of that request's context (default: all);
- ``drop_previous_output``: continue from that request's prompt, without its output;
- ``replace``: once this request finishes, the session forgets its other requests;
- ``append`` (set by the server, not the client): True on ``/generate``, where the request's
  tokens follow the session's context; False on the OpenAI routes, whose prompt is already
  the whole conversation (the session then only keeps its KV pinned).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.core.interfaces import StepStrategy
from radixserve.core.request import InvalidRequest, Req

# Finished requests a session remembers (by rid) for ``session_params.rid``: a long agent
# conversation holds its whole context per turn, so the oldest go first.
KEPT_REQUESTS = 16


@dataclass(frozen=True, slots=True)
class SessionParams:
    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False
    append: bool = True


class Session:
    """One open session: its requests' contexts and the pin on the newest one's KV."""

    __slots__ = (
        "id", "capacity", "ttl_s", "last_used", "contexts", "prompt_lens", "last_rid",
        "pin", "pinned_tokens", "pinned_at", "extra_key",
    )  # fmt: skip

    def __init__(self, session_id: str, capacity: int | None, ttl_s: float | None) -> None:
        self.id = session_id
        self.capacity = capacity  # most tokens a request of the session may hold
        self.ttl_s = ttl_s  # closed once unused this long (None: never)
        self.last_used = 0.0
        self.contexts: dict[str, list[int]] = {}  # rid -> its prompt + output
        self.prompt_lens: dict[str, int] = {}
        self.last_rid: str | None = None
        self.pin: Any = None  # the locked radix node of the newest context, or None
        self.pinned_tokens = 0
        self.pinned_at = 0
        self.extra_key: str | None = None


class SessionTable(StepStrategy):
    """The open sessions of one engine, as a step strategy: ``prepare`` puts a session's
    context before a request's tokens, ``ended`` records finished turns and moves the pin,
    ``poll`` closes expired sessions, ``pinned_tokens`` feeds the KV leak check."""

    def __init__(
        self,
        cache: Any,
        pool_size: int,
        pin_ratio: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.pin_limit = int(pool_size * pin_ratio)
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self._pins = 0  # a counter that orders pins oldest first
        self.demoted = 0  # pins dropped to stay within the bound

    # -- open and close -------------------------------------------------------------------

    def open_session(
        self, capacity: int | None = None, session_id: str | None = None, ttl_s: float | None = None
    ) -> str:
        """Open a session; return its id (``session_id``, or a fresh one)."""
        self.expire()
        if session_id is None:
            session_id = uuid.uuid4().hex
        if session_id in self.sessions:
            raise InvalidRequest(f"session '{session_id}' is already open", "session_id")
        if capacity is not None and capacity <= 0:
            raise InvalidRequest(f"capacity_of_str_len must be positive, got {capacity}")
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequest(f"ttl must be a positive number of seconds, got {ttl_s}")
        session = Session(session_id, capacity, ttl_s)
        session.last_used = self.clock()
        self.sessions[session_id] = session
        return session_id

    def close_session(self, session_id: str) -> None:
        """Close ``session_id``: its pin is dropped (its KV stays cached, evictable)."""
        self._unpin(self._get(session_id))
        del self.sessions[session_id]

    def expire(self) -> list[str]:
        """Close every session unused past its TTL; return their ids."""
        now = self.clock()
        gone = [s.id for s in self.sessions.values() if _expired(s, now)]
        for session_id in gone:
            self.close_session(session_id)
        return gone

    def _get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise InvalidRequest(
                f"unknown session '{session_id}': open one with /open_session first, or it "
                "was closed or expired",
                "session_params",
            )
        return session

    # -- the step strategy's hooks ----------------------------------------------------------

    def prepare(self, req: Any) -> None:
        params: SessionParams | None = req.session_params
        if params is None:
            return
        session = self._get(params.id)
        session.last_used = self.clock()
        if params.append:
            context = self._context(session, params)
            req.input_ids, req.context_tokens = context + list(req.input_ids), len(context)
        if session.capacity is not None and len(req.input_ids) > session.capacity:
            raise InvalidRequest(
                f"the request holds {len(req.input_ids)} tokens with session '{session.id}''s "
                f"context, past the session's capacity of {session.capacity}",
                "session_params",
            )

    def _context(self, session: Session, params: SessionParams) -> list[int]:
        rid = params.rid if params.rid is not None else session.last_rid
        if rid is None:
            return []  # the session's first request
        context = session.contexts.get(rid)
        if context is None:
            raise InvalidRequest(
                f"request '{rid}' is not a finished request of session '{session.id}'",
                "session_params",
            )
        if params.drop_previous_output:
            context = context[: session.prompt_lens[rid]]
        if params.offset is not None and params.offset >= 0:
            if params.offset > len(context):
                raise InvalidRequest(
                    f"session_params.offset {params.offset} is past the {len(context)} tokens "
                    f"of request '{rid}'",
                    "session_params",
                )
            context = context[: params.offset]
        return context

    def poll(self) -> list[Any]:
        if self.sessions:
            self.expire()
        return []

    def ended(self, reqs: list[Any]) -> None:
        for req in reqs:
            params = req.session_params
            if params is None or not req.finished or req.failed:
                continue
            if req.finish_reason is not None and req.finish_reason.type == "abort":
                continue
            session = self.sessions.get(params.id)
            if session is not None:  # else it closed while the request ran
                self._record(session, req, params)

    def _record(self, session: Session, req: Req, params: SessionParams) -> None:
        if params.replace:
            session.contexts.clear()
            session.prompt_lens.clear()
        context = list(req.input_ids) + list(req.output_ids)
        session.contexts[req.rid] = context
        session.prompt_lens[req.rid] = len(req.input_ids)
        while len(session.contexts) > KEPT_REQUESTS:  # the oldest cannot be continued any more
            oldest = next(iter(session.contexts))
            del session.contexts[oldest], session.prompt_lens[oldest]
        session.last_rid = req.rid
        session.last_used = self.clock()
        self._pin(session, context, req.extra_key)

    # -- pins -------------------------------------------------------------------------------

    def _pin(self, session: Session, context: list[int], extra_key: str | None) -> None:
        """Move ``session``'s pin to the cached part of ``context`` (the request was
        released: its whole pages are in the tree)."""
        kv, node = self.cache.match_prefix(context, extra_key)
        old = session.pin
        session.pin, session.pinned_tokens = None, 0
        if 0 < len(kv) <= self.pin_limit:
            self._make_room(len(kv))
            self.cache.inc_lock_ref(node)
            self._pins += 1
            session.pin, session.pinned_tokens, session.pinned_at = node, len(kv), self._pins
            session.extra_key = extra_key
        if old is not None:
            self.cache.dec_lock_ref(old)  # after the new lock: a shared prefix stays locked

    def _make_room(self, tokens: int) -> None:
        """Drop the oldest pins until ``tokens`` more fit within the bound."""
        pinned = sorted((s for s in self.sessions.values() if s.pin is not None),
                        key=lambda s: s.pinned_at)  # fmt: skip
        total = sum(s.pinned_tokens for s in pinned)
        for session in pinned:
            if total + tokens <= self.pin_limit:
                break
            total -= session.pinned_tokens
            self._unpin(session)
            self.demoted += 1

    def _unpin(self, session: Session) -> None:
        if session.pin is not None:
            self.cache.dec_lock_ref(session.pin)
        session.pin, session.pinned_tokens = None, 0

    def unpin_all(self) -> None:
        """Drop every pin (the cache is flushed); the sessions stay open."""
        for session in self.sessions.values():
            self._unpin(session)

    def pinned_tokens(self) -> int:
        """Tokens the pins hold in the tree (each shared node counted once): at idle, exactly
        the cache's locked size."""
        seen: set[int] = set()
        total = 0
        for session in self.sessions.values():
            node = session.pin
            while node is not None and node.parent is not None and id(node) not in seen:
                seen.add(id(node))
                total += len(node.key)
                node = node.parent
        return total

    def describe(self) -> dict[str, int]:
        """For /server_info and /metrics: open sessions, pinned tokens, pins demoted."""
        return {
            "open_sessions": len(self.sessions),
            "pinned_tokens": self.pinned_tokens(),
            "pin_limit": self.pin_limit,
            "demoted_pins": self.demoted,
        }


def _expired(session: Session, now: float) -> bool:
    return session.ttl_s is not None and now - session.last_used > session.ttl_s
