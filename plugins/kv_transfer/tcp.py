"""KV connector ``tcp``: prefill -> decode KV over plain TCP sockets, for tests and machines
without Mooncake or NIXL.

The prefill's bootstrap server listens on ``--disaggregation-bootstrap-port``. For each room a
decode opens one connection and sends ``Want`` (room, its KV layout, the prompt length); the
prefill answers, once the room's KV is ready, with ``Data`` followed by the raw KV bytes, or
with ``Gone`` (the prefill ended or refused the request, or the layouts differ; ``refused``
marks a refusal, which the decode answers as the client error it is). A decode that closes
the connection early gives the room up. A decode that refused a request (``refuse``) sends
``Drop`` on a connection of its own instead: the prefill gives the room up at once. Frames
are a 4-byte big-endian length, a msgpack header (msgspec structs) and, after ``Data``,
``nbytes`` of raw tensor bytes: no pickle.

KV bytes are staged in host memory: the prefill copies the prompt's slots out when ``send`` is
called (so the engine may reuse them at once), the decode writes them into its preallocated
slots on the engine's thread, in ``poll``. Payload layout: [2 * layers, tokens, kv_heads,
head_dim] in the pool's dtype (K then V of each layer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

import msgspec
import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import KVConnector, TransferEvent
from radixserve.core.memory import KVPool

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
# The decode engine's deadline (--disaggregation-transfer-timeout) decides when a transfer has
# taken too long, with one clear message; the connector's own timers wait this much longer so
# that they only catch an engine too wedged to check its deadlines, and never race it.
BACKSTOP_GRACE_S = 10.0
_LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 20


class Want(msgspec.Struct, tag="want", kw_only=True):
    room: int
    layout: str
    num_tokens: int
    target: bytes = b""  # where the KV goes, for connectors that write it remotely (mooncake)


class Data(msgspec.Struct, tag="data", kw_only=True):
    room: int
    num_tokens: int
    nbytes: int
    meta: bytes


class Gone(msgspec.Struct, tag="gone", kw_only=True):
    room: int
    message: str
    refused: bool = False  # the prefill refused the request (a client error, not a failure)


class Drop(msgspec.Struct, tag="drop", kw_only=True):
    """Decode -> prefill: the decode refused the room's request; no one will fetch its KV."""

    room: int
    message: str


Frame = Want | Data | Gone | Drop
_decoder = msgspec.msgpack.Decoder(Frame)
_encoder = msgspec.msgpack.Encoder()


class PeerError(Exception):
    """The other side broke the protocol or went away."""


def write_frame(sock: socket.socket, frame: msgspec.Struct) -> None:
    header = _encoder.encode(frame)
    sock.sendall(_LEN.pack(len(header)) + header)


def read_exact(sock: socket.socket, n: int, into: bytearray | None = None) -> bytearray:
    buf = into if into is not None else bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerError(f"the connection closed after {got} of {n} bytes")
        got += k
    return buf


def read_frame(sock: socket.socket) -> Frame:
    (n,) = _LEN.unpack(read_exact(sock, _LEN.size))
    if n > MAX_HEADER_BYTES:
        raise PeerError(f"a frame header of {n} bytes is too large")
    try:
        return _decoder.decode(read_exact(sock, n))
    except msgspec.DecodeError as e:
        raise PeerError(f"an unreadable frame: {e}") from None


def pool_layout(pool: KVPool) -> str:
    k = pool.k[0]
    return f"{len(pool.k)}x{k.shape[1]}x{k.shape[2]}:{k.dtype}".replace("torch.", "")


class _Ready:
    """A room's KV and metadata on the prefill, until a decode takes it or it expires."""

    __slots__ = ("payload", "num_tokens", "meta", "expires")

    def __init__(self, payload: Any, num_tokens: int, meta: bytes, expires: float) -> None:
        self.payload, self.num_tokens, self.meta, self.expires = payload, num_tokens, meta, expires


class TcpKVConnector(KVConnector):
    def __init__(self) -> None:
        self.role = ""
        self.pool: KVPool | None = None
        self.timeout = 300.0
        self.layout = ""
        self._lock = threading.Condition()
        self._events: list[TransferEvent] = []
        self._closed = False
        # prefill
        self._server: socket.socket | None = None
        self._ready: dict[int, _Ready] = {}
        self._gone: dict[int, tuple[str, bool, float]] = {}  # room -> (why, refused, expires)
        self._refused: dict[int, tuple[str, float]] = {}  # room -> (why, expires): Drop
        # decode
        self._received: list[tuple[int, torch.Tensor, bytes, bytearray | None]] = []
        self._conns: dict[int, socket.socket] = {}
        self._cancelled: set[int] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.wakeup_fd = self._wake_r

    # -- both sides --------------------------------------------------------------------------

    def start(self, role: str, kv_pool: KVPool, bootstrap_port: int, timeout: float) -> None:
        self.role, self.pool, self.timeout = role, kv_pool, timeout
        self.layout = pool_layout(kv_pool)
        if role == "prefill":
            host = self.bootstrap_host
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            server = socket.create_server((host, bootstrap_port), family=family, reuse_port=False)
            self._server = server
            threading.Thread(target=self._accept, name="kv-bootstrap", daemon=True).start()
            # Staged KV expires on its own, also while the engine sleeps (no step, no poll).
            threading.Thread(target=self._expire_loop, name="kv-expire", daemon=True).start()
            logger.info("KV bootstrap server (tcp) on %s:%d", host or "*", bootstrap_port)

    def poll(self) -> list[TransferEvent]:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        with self._lock:
            events, self._events = self._events, []
            received, self._received = self._received, []
            self._expire(time.monotonic())
        for room, slots, meta, payload in received:
            if payload is None:  # already in the slots
                events.append(TransferEvent(room, True, meta=meta))
            else:
                events.append(self._store(room, slots, meta, payload))
        return events

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
            self._lock.notify_all()
        for conn in conns:
            _shut(conn)
        if self._server is not None:
            _shut(self._server)

    def _event(self, event: TransferEvent) -> None:
        with self._lock:
            self._events.append(event)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"!")

    # -- prefill -------------------------------------------------------------------------------

    def send(self, room: int, kv_slots: torch.Tensor, meta: bytes) -> None:
        with self._lock:
            if room in self._refused:
                return  # the decode refused it: no one will ask
        pool = self.pool
        assert pool is not None
        k = pool.k[0]
        index = kv_slots.to(k.device)
        parts = [t for layer in range(len(pool.k)) for t in (pool.k[layer], pool.v[layer])]
        # Gathered into one tensor (a stack of per-layer copies would hold the KV twice).
        data = torch.empty((len(parts), len(index), *k.shape[1:]), dtype=k.dtype, device=k.device)
        for i, t in enumerate(parts):
            torch.index_select(t, 0, index, out=data[i])
        payload = self.stage(data)
        with self._lock:
            self._gone.pop(room, None)
            self._ready[room] = _Ready(payload, len(kv_slots), meta, self._deadline())
            self._lock.notify_all()

    def stage(self, data: torch.Tensor) -> Any:
        """Where a room's gathered KV waits for its decode: here host memory, as raw bytes
        (uint8 [2 * layers, tokens, row bytes]), sent as they are."""
        return data.cpu().view(torch.uint8).flatten(2).numpy()

    def cancel(self, room: int, reason: str, refused: bool = False) -> None:
        if self.role == "decode":
            with self._lock:
                self._cancelled.add(room)
                conn = self._conns.pop(room, None)
            if conn is not None:
                _shut(conn)  # the prefill sees the connection close: the room is given up
            return
        with self._lock:
            self._ready.pop(room, None)
            self._gone[room] = (reason, refused, self._deadline())
            self._lock.notify_all()

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _expire_loop(self) -> None:
        """Prefill: expire rooms when they are due, whether or not the engine polls."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                self._expire(now)
                due = [e.expires for e in self._ready.values()]
                due += [e[-1] for e in (*self._gone.values(), *self._refused.values())]
                # woken early (notify_all) when a room is staged, given up or refused
                self._lock.wait(max(min(due) - now, 0.0) + 0.01 if due else None)

    def _expire(self, now: float) -> None:
        """Drop rooms no decode asked for in time (called with the lock held)."""
        for room in [r for r, ready in self._ready.items() if ready.expires <= now]:
            logger.warning("no decode server asked for the KV of room %d; dropped it", room)
            del self._ready[room]
        for room in [r for r, (*_, expires) in self._gone.items() if expires <= now]:
            del self._gone[room]
        for room in [r for r, (_, expires) in self._refused.items() if expires <= now]:
            del self._refused[room]

    def refused(self, room: int) -> str | None:
        with self._lock:
            entry = self._refused.get(room)
        return entry[0] if entry is not None else None

    def _drop(self, room: int, message: str) -> None:
        """A decode refused ``room``: drop its KV, answer a later ``Want`` with ``Gone``, and
        report it (a running request is aborted; ``refused`` names it to a late one)."""
        with self._lock:
            self._ready.pop(room, None)
            self._gone[room] = (message, False, self._deadline())
            self._refused[room] = (message, self._deadline())
            self._lock.notify_all()
        logger.warning("room %d given up: %s", room, message)
        self._event(TransferEvent(room, False, error=message))

    def _accept(self) -> None:
        assert self._server is not None
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="kv-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One decode's request for one room: wait for the room's KV, then send it."""
        room = None
        try:
            with conn:
                conn.settimeout(CONNECT_TIMEOUT_S)
                want = read_frame(conn)
                if isinstance(want, Drop):
                    self._drop(want.room, want.message)
                    return
                if not isinstance(want, Want):
                    raise PeerError(f"expected a want frame, got {type(want).__name__}")
                room = want.room
                if want.layout != self.layout:
                    message = (
                        f"KV layouts differ: prefill {self.layout}, decode {want.layout}; both "
                        "servers must run the same model and dtype"
                    )
                    write_frame(conn, Gone(room=room, message=message))
                    return
                conn.settimeout(None)
                found = self._wait_for(room, conn)
                if found is None:
                    return
                if isinstance(found, tuple):
                    why, refused = found
                    write_frame(conn, Gone(room=room, message=why, refused=refused))
                    return
                if found.num_tokens != want.num_tokens:
                    message = (
                        f"the prefill server computed {found.num_tokens} prompt tokens, the "
                        f"decode server expects {want.num_tokens}"
                    )
                    write_frame(conn, Gone(room=room, message=message))
                    return
                self.send_data(conn, want, found)
        except (OSError, PeerError) as e:
            if room is not None:
                self._event(TransferEvent(room, False, error=f"sending to the decode failed: {e}"))

    def send_data(self, conn: socket.socket, want: Want, ready: _Ready) -> None:
        """Deliver one room's KV to the decode behind ``conn``: here the data frame and the
        bytes (subclasses write it elsewhere, tests inject faults)."""
        frame = Data(room=want.room, num_tokens=ready.num_tokens, nbytes=ready.payload.nbytes,
                     meta=ready.meta)  # fmt: skip
        write_frame(conn, frame)
        conn.sendall(ready.payload)

    def _wait_for(self, room: int, conn: socket.socket) -> _Ready | tuple[str, bool] | None:
        """The room's KV (taken), why the prefill gave it up and whether it refused the
        request, or None when the decode went away or the wait timed out (the room is then
        given up here too)."""
        deadline = self._deadline() + BACKSTOP_GRACE_S
        with self._lock:
            while True:
                if room in self._ready:
                    return self._ready.pop(room)
                if room in self._gone:
                    why, refused, _ = self._gone.pop(room)
                    return why, refused
                if self._closed:
                    return "the prefill server is shutting down", False
                if time.monotonic() >= deadline:
                    return f"the prefill server got no request for room {room} in time", False
                self._lock.wait(0.2)
                if _peer_closed(conn):
                    break
        self._event(TransferEvent(room, False, error="the decode server closed the connection"))
        return None

    # -- decode --------------------------------------------------------------------------------

    def refuse(self, room: int, peer: tuple[str, int], reason: str) -> None:
        args = (room, peer, reason)
        threading.Thread(target=self._send_drop, args=args, name="kv-drop", daemon=True).start()

    def _send_drop(self, room: int, peer: tuple[str, int], reason: str) -> None:
        try:
            with socket.create_connection(peer, timeout=CONNECT_TIMEOUT_S) as conn:
                write_frame(conn, Drop(room=room, message=reason))
        except OSError as e:  # the prefill will time the room out instead
            logger.warning("cannot tell the prefill %s:%d about room %d: %s", *peer, room, e)

    def receive(self, room: int, peer: tuple[str, int], kv_slots: torch.Tensor) -> None:
        with self._lock:
            self._cancelled.discard(room)
        args = (room, peer, kv_slots)
        threading.Thread(target=self._fetch, args=args, name="kv-recv", daemon=True).start()

    def _fetch(self, room: int, peer: tuple[str, int], slots: torch.Tensor) -> None:
        where = f"{peer[0]}:{peer[1]}"
        try:
            conn = socket.create_connection(peer, timeout=CONNECT_TIMEOUT_S)
        except OSError as e:
            self._fail(room, f"cannot reach the prefill's bootstrap server {where}: {e}")
            return
        with self._lock:
            if room in self._cancelled or self._closed:
                _shut(conn)
                return
            self._conns[room] = conn
        try:
            with conn:
                want = Want(room=room, layout=self.layout, num_tokens=len(slots),
                            target=self.want_target(slots))  # fmt: skip
                write_frame(conn, want)
                conn.settimeout(self.timeout + BACKSTOP_GRACE_S)
                frame = read_frame(conn)
                if isinstance(frame, Gone):
                    self._fail(room, f"{where}: {frame.message}", frame.refused)
                    return
                if not isinstance(frame, Data) or frame.room != room:
                    raise PeerError(f"unexpected frame {frame!r:.80}")
                payload = self.receive_payload(conn, frame, slots)
        except (OSError, PeerError) as e:
            self._fail(room, f"the connection to the prefill server {where} failed: {e}")
            return
        finally:
            with self._lock:
                self._conns.pop(room, None)
        with self._lock:
            if room in self._cancelled:
                return
            self._received.append((room, slots, frame.meta, payload))
        self._wake()

    def want_target(self, slots: torch.Tensor) -> bytes:
        """What the prefill needs to write into ``slots`` itself (nothing here: the KV comes
        over the connection)."""
        return b""

    def receive_payload(
        self, conn: socket.socket, frame: Data, slots: torch.Tensor
    ) -> bytearray | None:
        """Read the KV that follows ``frame``; None when the prefill already wrote it into
        the slots (``poll`` then has nothing to copy)."""
        expected = len(slots) * self._bytes_per_token()
        if frame.nbytes != expected:
            raise PeerError(f"{frame.nbytes} bytes of KV, expected {expected}")
        return read_exact(conn, frame.nbytes)

    def _fail(self, room: int, message: str, refused: bool = False) -> None:
        with self._lock:
            if room in self._cancelled:
                return
        self._event(TransferEvent(room, False, error=message, refused=refused))

    def _bytes_per_token(self) -> int:
        pool = self.pool
        assert pool is not None
        k = pool.k[0]
        return 2 * len(pool.k) * k.shape[1] * k.shape[2] * k.element_size()

    def _store(
        self, room: int, slots: torch.Tensor, meta: bytes, payload: bytearray
    ) -> TransferEvent:
        """Write a room's received KV into its slots (on the engine's thread)."""
        pool = self.pool
        assert pool is not None
        k = pool.k[0]
        raw = torch.frombuffer(payload, dtype=torch.uint8)
        data = raw.view(k.dtype).view(2 * len(pool.k), len(slots), k.shape[1], k.shape[2])
        data = data.to(k.device)
        index = slots.to(k.device)
        for layer in range(len(pool.k)):
            pool.k[layer].index_copy_(0, index, data[2 * layer])
            pool.v[layer].index_copy_(0, index, data[2 * layer + 1])
        return TransferEvent(room, True, meta=meta)


def _peer_closed(conn: socket.socket) -> bool:
    """Whether the decode closed its end (it sends nothing after its want frame)."""
    try:
        conn.setblocking(False)
        try:
            return conn.recv(1, socket.MSG_PEEK) == b""
        finally:
            conn.setblocking(True)
    except BlockingIOError:
        return False
    except OSError:
        return True


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


@hookimpl
def register_kv_connectors(register) -> None:  # type: ignore[no-untyped-def]
    register("tcp", TcpKVConnector, description="KV over plain TCP sockets (staged in host memory)")
