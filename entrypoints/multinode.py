"""Multi-node launch (``--nnodes N --node-rank R --dist-init-addr host:port``): the
tensor-parallel ranks spread over several launches, one per node, and the watch that ends every
node when one of them dies.

Each launch starts its node's share of the ranks, ``tp_size / nnodes`` of them: node R runs
ranks ``R * k .. R * k + k - 1``. They meet through torch.distributed's TCP store at
``dist_init_addr`` (hosted by rank 0). Node 0 is the server: its engine process is rank 0, which
schedules and broadcasts each step (core/tp_step.py), and it serves HTTP. The other nodes only
follow (``follow``): they start their ranks as the server starts its own (entrypoints/
tp_workers.py) and watch them, with no HTTP server.

The node watch: node 0 listens on ``port + 1`` (``NodeWatch``); every other node connects to it
and keeps the connection open while it runs. When one of a follower's ranks dies, the follower
sends one line saying which rank and how, ends its other ranks and exits non-zero; node 0's
engine dies with that line as the reason and the server exits non-zero. A connection that closes
without a word (a node killed outright, a broken network) ends node 0 the same way, naming the
node and its ranks. Node 0 says "stop" to the others before an orderly stop (its rank 0 then
stops every rank); a follower whose connection closes, or whose ranks are stopped, without that
word knows node 0 died (a killed server's engine still stops the ranks on its way out) and ends
itself with a non-zero exit. Nothing waits for a collective's timeout.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from radixserve.entrypoints import tp_workers

if TYPE_CHECKING:
    from radixserve.core.distributed import Rendezvous

logger = logging.getLogger(__name__)

#: seconds a follower keeps trying to reach node 0's watch before it gives up
CONNECT_TIMEOUT_S = 120.0
#: after node 0's connection closed, how long a follower waits for its ranks' orderly exit
ORDERLY_EXIT_S = 5.0
#: after one rank stopped in order, how long a follower waits for its other ranks to stop
ORDERLY_GRACE_S = 10.0
#: what node 0 sends the other nodes before an orderly stop (their ranks then exit 0)
STOP_WORD = b"stop\n"
#: after node 0's engine failed, how long it waits for a follower's word on which rank died
WORD_WAIT_S = 2.0


def nodes(settings: dict[str, Any]) -> int:
    return int(settings.get("nnodes") or 1)


def address(settings: dict[str, Any]) -> tuple[str, int]:
    host, _, port = str(settings["dist_init_addr"]).rpartition(":")
    return host.strip("[]"), int(port)


def node_ranks(settings: dict[str, Any]) -> range:
    """The tensor-parallel ranks this launch runs."""
    per = int(settings.get("tp_size") or 1) // nodes(settings)
    node = int(settings.get("node_rank") or 0)
    return range(node * per, (node + 1) * per)


def rendezvous(settings: dict[str, Any]) -> list[Rendezvous]:
    """One Rendezvous per rank of this node, meeting at ``dist_init_addr``'s TCP store."""
    from radixserve.core.distributed import Rendezvous

    host, port = address(settings)
    host = f"[{host}]" if ":" in host else host
    size = int(settings["tp_size"])
    timeout = float(settings.get("watchdog_timeout") or 300)
    return [Rendezvous(f"tcp://{host}:{port}", r, size, timeout) for r in node_ranks(settings)]


def _describe_node(settings: dict[str, Any], node: int) -> str:
    per = int(settings["tp_size"]) // nodes(settings)
    ranks = range(node * per, (node + 1) * per)
    which = f"rank {ranks[0]}" if per == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return f"node {node} (tensor-parallel {which})"


class NodeWatch:
    """Node 0's side of the node watch: accepts one connection per other node and calls
    ``on_death(reason)`` once, from a daemon thread, when one reports a dead rank or closes."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        host, port = address(settings)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.server = socket.socket(family, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((host, port + 1))
        self.server.listen(nodes(settings))
        self.dead: str | None = None
        self.on_death: Callable[[str], None] = lambda _: None
        self.stopping = False
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="node-watch", daemon=True).start()

    def _accept(self) -> None:
        for _ in range(nodes(self.settings) - 1):
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed: the server stops
                return
            self._conns.append(conn)
            threading.Thread(target=self._follow, args=(conn,), daemon=True).start()

    def _follow(self, conn: socket.socket) -> None:
        reader = conn.makefile("r", encoding="utf-8", errors="replace")
        try:
            hello = reader.readline().split()
            node = int(hello[1]) if len(hello) == 2 and hello[0] == "node" else None
            word = reader.readline().strip() if node is not None else ""
        except (OSError, ValueError):
            node, word = None, ""
        if node is None:
            self._died("a node connected to the node watch but did not say which it is")
        elif word:
            self._died(f"node {node}: {word}")
        else:
            self._died(f"{_describe_node(self.settings, node)} is gone: its connection closed")

    def _died(self, reason: str) -> None:
        with self._lock:
            if self.stopping or self.dead is not None:
                return
            self.dead = reason
        self.on_death(reason)

    def word(self, timeout_s: float) -> str | None:
        """The reason a node gave, waiting up to ``timeout_s`` for one."""
        deadline = time.monotonic() + timeout_s
        while self.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.dead

    def announce_stop(self) -> None:
        """Tell the other nodes an orderly stop follows (rank 0 is about to stop the group);
        closed connections are expected from here on."""
        with self._lock:
            self.stopping = True
        for conn in self._conns:
            try:
                conn.sendall(STOP_WORD)
            except OSError:
                pass  # that node is gone: nothing to tell

    def close(self) -> None:
        """An orderly stop follows: closed connections are expected from here on."""
        with self._lock:
            self.stopping = True
        self.server.close()
        for conn in self._conns:
            conn.close()


def follow(settings: dict[str, Any]) -> int:
    """A launch with ``node_rank`` > 0: start this node's ranks, tell node 0 it is here, and
    watch both until the ranks stop. Returns the exit code (0 after an orderly stop)."""
    node = int(settings["node_rank"])
    host, port = address(settings)
    try:
        conn = _connect(host, port + 1, CONNECT_TIMEOUT_S)
    except OSError as e:
        print(f"radixserve: node {node} could not reach node 0 at {host}:{port + 1}: {e}",
              file=sys.stderr)  # fmt: skip
        return 1
    ranks = rendezvous(settings)
    procs = tp_workers.start_workers(settings, ranks)
    pairs = [(r.rank, p) for r, p in zip(ranks, procs, strict=True)]
    print(
        f"radixserve: node {node} of {nodes(settings)} follows node 0 at {host}:{port} with "
        f"tensor-parallel ranks {', '.join(str(r) for r, _ in pairs)}; no HTTP server on this "
        "node",
        flush=True,
    )
    try:
        conn.sendall(f"node {node}\n".encode())
        return _watch(conn, pairs, node)
    finally:
        tp_workers.end_all(procs, 0.0)
        conn.close()


def _watch(conn: socket.socket, pairs: Sequence[tuple[int, BaseProcess]], node: int) -> int:
    """Until this node's ranks end: 0 after node 0 said it stops (its ``STOP_WORD``) and they
    stopped cleanly, else 1 with a line saying which rank or node ended first."""
    sentinels = {p.sentinel: (rank, p) for rank, p in pairs}
    told = False  # node 0 said an orderly stop follows
    while True:
        for item in wait([conn, *sentinels]):
            if item is conn:
                data = conn.recv(4096)
                told = told or STOP_WORD in data
                if data:
                    continue
                if told:
                    return _orderly(pairs, node, ORDERLY_EXIT_S)
                return _fail(node, "node 0 (tensor-parallel rank 0, the server) is gone: its "
                             "connection closed")  # fmt: skip
            rank, proc = sentinels[item]  # type: ignore[index]
            proc.join(1)
            if proc.exitcode == 0 and (told or _told(conn, WORD_WAIT_S)):
                return _orderly(pairs, node, ORDERLY_GRACE_S)
            why = tp_workers.describe_exit(rank, proc)
            if proc.exitcode == 0:  # rank 0 stopped it, but node 0 said nothing: it died
                why = f"node 0 (tensor-parallel rank 0, the server) ended without a word ({why})"
            try:
                conn.sendall(f"{why}\n".encode())
            except OSError:
                pass  # node 0 is gone too
            return _fail(node, why)


def _told(conn: socket.socket, timeout_s: float) -> bool:
    """Whether node 0 says it stops in order within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while wait([conn], max(0.0, deadline - time.monotonic())):
        data = conn.recv(4096)
        if STOP_WORD in data:
            return True
        if not data:
            return False
    return False


def _fail(node: int, why: str) -> int:
    print(f"radixserve: node {node}: {why}; ending this node", file=sys.stderr, flush=True)
    return 1


def _orderly(pairs: Sequence[tuple[int, BaseProcess]], node: int, grace_s: float) -> int:
    tp_workers.end_all([p for _, p in pairs], grace_s)
    bad = [tp_workers.describe_exit(r, p) for r, p in pairs if p.exitcode != 0]
    if bad:
        return _fail(node, bad[0])
    print(f"radixserve: node {node}: node 0 stopped the group; exiting", flush=True)
    return 0


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            conn.settimeout(None)
            return conn
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
