"""A third-party KV connector for the disaggregation fault tests, installed through its entry
point (``model_gate.install_plugin``) so the servers' engine processes load it the real way.

``tcp_faults`` is the ``tcp`` connector, except that its prefill side misbehaves for the rooms
a test marks (``room % 1000``):

- DROP_ROOM: sends the data frame and half of the KV bytes, then closes the connection.
- STALL_ROOM: sends the data frame and half of the KV bytes, creates ``stalled-<room>`` in
  ``$RADIXSERVE_TEST_KV_FAULT_DIR`` and waits there for good (the test kills the server).
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

import radixserve
from radixserve.plugins.kv_transfer.tcp import Data, TcpKVConnector, Want, write_frame

DROP_ROOM = 901
STALL_ROOM = 902
FAULT_DIR_ENV = "RADIXSERVE_TEST_KV_FAULT_DIR"


class FaultyTcpConnector(TcpKVConnector):
    def send_data(self, conn: socket.socket, want: Want, ready: Any) -> None:
        room = want.room
        kind = room % 1000
        if kind not in (DROP_ROOM, STALL_ROOM):
            super().send_data(conn, want, ready)
            return
        payload = ready.payload.reshape(-1)
        frame = Data(room=room, num_tokens=ready.num_tokens, nbytes=payload.nbytes,
                     meta=ready.meta)  # fmt: skip
        write_frame(conn, frame)
        conn.sendall(payload[: payload.nbytes // 2])
        if kind == DROP_ROOM:
            conn.shutdown(socket.SHUT_RDWR)
            return
        (Path(os.environ[FAULT_DIR_ENV]) / f"stalled-{room}").touch()
        threading.Event().wait()  # until the process is killed


@radixserve.hookimpl
def register_kv_connectors(register: Any) -> None:
    register("tcp_faults", FaultyTcpConnector, description="test: tcp with injected faults")
