"""The contract of KV-transfer plugins for prefill/decode disaggregation (re-exported by
core/interfaces.py, where every plugin kind's contract is found)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from radixserve.core.memory import KVPool


@dataclass(frozen=True)
class TransferEvent:
    """What a connector reports about one room (``KVConnector.poll``).

    Decode side: ``ok`` True once the room's KV is in the slots given to ``receive`` and
    ``meta`` holds the prefill's message; ``ok`` False when the transfer failed (``error``
    names the peer and the cause), with ``refused`` True when the prefill refused the request
    (``cancel(..., refused=True)``: a client error, which the decode answers with a 400 and
    ``error``, not a failure). Prefill side: ``ok`` False when the decode gave the room up
    (aborted, timed out, disconnected) before or while it was sent.
    """

    room: int
    ok: bool
    meta: bytes = b""
    error: str = ""
    refused: bool = False


class KVConnector(ABC):
    """Moves one request's prompt KV and a small metadata message from a prefill engine to a
    decode engine (prefill/decode disaggregation; the request states live in
    ``core/disaggregation.py``). Built by its registered factory with no arguments.

    Rooms: a router gives both engines the same ``bootstrap_room`` (an integer) for one
    request; it names the transfer on both sides. The decode learns the prefill's bootstrap
    address (host, port) from the request too.

    Unit of kv indices: token slots of the KV pool (row ``s`` of every layer's
    ``KVPool.k[layer]`` and ``KVPool.v[layer]``), in position order. The decode engine
    allocates its slots in whole pages before the transfer starts; the prefill's slots hold the
    prompt's positions ``0 .. n-1`` in its own pool, whatever its page size.

    Threads: every method is called on the engine's thread and must not block on the network;
    a connector does its I/O on its own threads and reports through ``poll``. It must never
    raise from ``poll``: a transfer that cannot complete is a ``TransferEvent`` with ``ok``
    False. No pickle on any socket.
    """

    #: A file descriptor that is readable while ``poll`` has events; the engine waits on it
    #: (with its inbound socket) when it has nothing else to do. None: the engine polls.
    wakeup_fd: int | None = None
    #: Prefill: the address its bootstrap server listens on (the server's --host; "": every
    #: interface). Set by the engine before ``start``.
    bootstrap_host: str = ""

    @abstractmethod
    def start(self, role: str, kv_pool: KVPool, bootstrap_port: int, timeout: float) -> None:
        """Called once before the first request. ``role`` is "prefill" or "decode". A prefill
        serves decode engines on ``bootstrap_port`` (its bootstrap server). ``timeout``:
        seconds a prefill keeps a room's data that no decode has asked for, and a decode waits
        for a room's data, before the room fails."""

    @abstractmethod
    def send(self, room: int, kv_slots: torch.Tensor, meta: bytes) -> None:
        """Prefill: the KV of ``kv_slots`` (the prompt's positions) is final; deliver it and
        ``meta`` to the decode engine that asks for ``room``. The engine may reuse the slots
        once this returns, so the connector must have read (or copied) them by then."""

    @abstractmethod
    def receive(self, room: int, peer: tuple[str, int], kv_slots: torch.Tensor) -> None:
        """Decode: fetch ``room``'s KV from the prefill's bootstrap server ``peer`` into
        ``kv_slots`` (preallocated, one per prompt token). A size or layout that does not
        match the prefill's fails the room. Completion or failure comes through ``poll``."""

    @abstractmethod
    def cancel(self, room: int, reason: str, refused: bool = False) -> None:
        """Give ``room`` up on this side; the peer learns it (a decode's ``receive`` fails with
        ``reason``, and with ``refused`` when it is set: the prefill refused the request, a
        client error; a prefill reports the room through ``poll`` and drops its data). No
        event for ``room`` follows on this side. Unknown rooms are ignored."""

    @abstractmethod
    def poll(self) -> list[TransferEvent]:
        """Events since the last call; on a decode, the KV of an ``ok`` room is in its slots
        when the event is returned."""

    def refuse(self, room: int, peer: tuple[str, int], reason: str) -> None:  # noqa: B027
        """Decode: this server refused a request of ``room`` before asking for its KV (bad
        input, overload). Tell the prefill at ``peer`` (its bootstrap server), without
        blocking, so that it gives the room up at once: it reports the room through ``poll``
        (a running request is aborted), drops KV it holds for it, and ``refused`` names the
        reason if the request comes later. Optional: without it the prefill keeps the room's
        KV until the transfer timeout."""

    def refused(self, room: int) -> str | None:
        """Prefill: why a decode refused ``room`` (see ``refuse``), else None."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop the connector's threads and servers (the engine is shutting down)."""
