"""uvicorn's h11 protocol with read deadlines: the slowloris guard (--request-read-timeout).

uvicorn bounds only the idle time between requests, and any byte received resets that clock, so
a client that trickles a request head (or body) a byte at a time holds its connection, and a
task, forever. Here a request's head must arrive within the timeout, counted from the moment the
connection opens or the previous response ends, and its body within the timeout again from the
end of the head. A client too slow for either gets 408 (when no response has started) and the
connection is closed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.entrypoints.http_errors import error_body


def guarded_h11(read_timeout: float) -> type[H11Protocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout": read_timeout})


class GuardedH11Protocol(H11Protocol):
    read_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # what is being awaited: "head", "body" or nothing
        self._started = False  # bytes of the awaited head came in

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._started = True
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def _follow_request(self) -> None:
        """Keep the one deadline in step with the request being read: its head, its body, or
        none once the whole request is in (the app's run time is not bounded here)."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._phase != "head":
                self._arm("head")
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        elif self._phase is not None:
            self._disarm()

    def _arm(self, phase: str) -> None:
        self._disarm()
        self._phase, self._started = phase, False
        self._deadline = self.loop.call_later(self.read_timeout, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self, phase: str) -> None:
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        # An idle connection is closed quietly (as uvicorn's keep-alive timeout does: a 408 could
        # cross the client's next request); a late head or body gets a 408 first, unless the app
        # already answered.
        if self._started if phase == "head" else not (self.cycle and self.cycle.response_started):
            what = "request head" if phase == "head" else "request body"
            message = (
                f"the {what} did not arrive within {self.read_timeout:g} s "
                "(--request-read-timeout); closing the connection"
            )
            data = json.dumps(error_body(408, message)).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: " + str(len(data)).encode() + b"\r\n\r\n"
                + data
            )  # fmt: skip
        # The app, if it is waiting for the body, sees a disconnect.
        self.transport.close()
