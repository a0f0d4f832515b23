"""The offline Engine's transport: how callers' threads hand requests and calls to the engine
loop's thread (one inbox), and how each request's progress comes back to its caller (one queue
per request, a snapshot per step, then ``FINISHED``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from radixserve.core.request import FinishReason, Req
from radixserve.core.stop import streamable_text
from radixserve.entrypoints import ipc
from radixserve.entrypoints.engine_loop import Inbound, Transport


class QueueTransport(Transport):
    """The offline Engine's side of the loop: callers queue messages in ``inbox`` (a Req to
    add, ipc structs for the rest); each request's progress goes to its caller's own queue as
    a snapshot taken between steps, then ``FINISHED``."""

    def __init__(
        self, check_running: Callable[[], None], record_error: Callable[[Exception], None]
    ) -> None:
        self._check_running = check_running  # raises once the engine is closed or dead
        self._record_error = record_error  # keeps the engine's first error, for later calls
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self._pending: list[Inbound] = []  # taken from the inbox by ``wait``
        # Held to queue work and to close the inbox, so nothing is queued after the loop's
        # last look at it (that caller would wait forever).
        self._lock = threading.Lock()
        self.closed = False
        self._outboxes: dict[str, tuple[Req, queue.Queue[Any], list[int]]] = {}
        self._calls: dict[int, queue.Queue[bool]] = {}

    # -- the callers' side -------------------------------------------------------------------

    def submit(self, req: Req) -> queue.Queue[Any]:
        box: queue.Queue[Any] = queue.Queue()
        with self._lock:
            self._check_running()
            self._outboxes[req.rid] = (req, box, [0])
            self.inbox.put(req)
        return box

    def call(self, msg: Any) -> Any:
        answer: queue.Queue[Any] = queue.Queue()
        with self._lock:
            self._check_running()
            self._calls[msg.call_id] = answer
            self.inbox.put(msg)
        return answer.get()

    # -- the loop's side ---------------------------------------------------------------------

    def wait(self, timeout: float | None) -> bool:
        try:
            self._pending.append(self.inbox.get(timeout=timeout))
        except queue.Empty:
            pass
        return True  # the caller is this process

    def receive(self) -> Iterator[Inbound]:
        while self._pending:
            yield self._pending.pop(0)
        while True:
            try:
                yield self.inbox.get_nowait()
            except queue.Empty:
                return

    def deliver(self, req: Req, error_status: int = 0) -> int:
        entry = self._outboxes.get(req.rid)
        if entry is None:
            return 0
        _, box, sent = entry
        new = len(req.output_ids) - sent[0]
        sent[0] = len(req.output_ids)
        if req.finished:
            self._outboxes.pop(req.rid, None)
            box.put(FINISHED)
        else:
            # A snapshot taken here, between steps: the caller's thread never reads text that
            # the next step is changing (a stop string appended, then cut). A tail that could
            # still become a stop string is held back, as the server holds it back.
            text = req.detok.text if req.detok is not None else ""
            spec = (req.spec_verify_ct, req.spec_accepted_tokens)
            box.put((len(req.output_ids), streamable_text(text, req.sampling.stop), spec))
        return new

    def reply(self, msg: ipc.EngineOutbound) -> None:
        if isinstance(msg, ipc.FlushCacheReply):
            self._calls.pop(msg.call_id).put(msg.ok)
        elif isinstance(msg, ipc.LoraReply):
            self._calls.pop(msg.call_id).put(lora_reply_json(msg))

    def close(self, error: Exception | None, handling: Inbound | None) -> None:
        """Requests still running or queued end with an abort naming why, a flush waiting for
        its answer gets False, and later calls an EngineDeadError."""
        if error is None:
            message = "engine shut down"
        else:
            message = f"engine error: {error}"
            self._record_error(error)
            if handling is not None:  # taken from the inbox already: answer it here
                self._refuse(handling, message)
        with self._lock:
            self.closed = True
            for item in self._pending:
                self._refuse(item, message)
            while True:
                try:
                    self._refuse(self.inbox.get_nowait(), message)
                except queue.Empty:
                    break
        for req, _, _ in list(self._outboxes.values()):
            self._refuse(req, message)

    def _refuse(self, item: Inbound, message: str) -> None:
        """Answer a message the loop will not carry out: a request ends with ``message``, a
        flush reports False."""
        if isinstance(item, Req):
            if not item.finished:
                item.finish(FinishReason("abort", message=message))
            self.deliver(item)
        elif isinstance(item, ipc.FlushCacheRequest):
            self._calls.pop(item.call_id).put(False)
        elif isinstance(item, ipc.LoadLoraRequest | ipc.UnloadLoraRequest):
            self._calls.pop(item.call_id).put({"success": False, "error_message": message})


FINISHED = object()


def lora_reply_json(msg: ipc.LoraReply) -> dict[str, Any]:
    """A LoRA call's reply as SGLang's /load_lora_adapter answers it."""
    return {"success": msg.success, "error_message": msg.error_message,
            "loaded_adapters": msg.loaded_adapters}  # fmt: skip
