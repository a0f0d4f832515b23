"""The slowloris guard (--request-read-timeout) on a real server: a client that trickles its
request head or body gets 408 and its connection closed, an idle connection is closed quietly,
other clients are served meanwhile, and the flag is documented."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hardening import generate, own_server
from server_process import RunningServer

from radixserve.entrypoints.server_args import build_parser

READ_TIMEOUT_S = 1.0
HANG_GUARD_S = 60.0  # only stops a hung test; nothing here measures speed

pytestmark = pytest.mark.slow  # its own server


@pytest.fixture(scope="module")
def guarded(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("slowloris") / "server.log"
    flags = ("--request-read-timeout", str(READ_TIMEOUT_S))
    with own_server(tiny_long_llama_dir, log, *flags) as running:
        yield running


def _connect(server: RunningServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=HANG_GUARD_S)
    return sock


def _trickle_until_closed(sock: socket.socket, data: bytes) -> bytes:
    """Send ``data`` a byte at a time, each well within the read timeout, until the server
    closes the connection; return what it sent back."""
    sock.settimeout(READ_TIMEOUT_S / 4)
    received = b""
    deadline = time.monotonic() + HANG_GUARD_S
    for i in range(10**6):
        assert time.monotonic() < deadline, "the server kept a trickling client"
        try:
            sock.send(data[i % len(data) : i % len(data) + 1])
        except OSError:
            break  # reset: closed
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        received += chunk
    return received


def _status_and_error(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]["message"]


def test_trickled_head_gets_408_and_is_closed(guarded: RunningServer) -> None:
    with _connect(guarded) as sock:
        # A head that never ends: one more header line every quarter of the timeout.
        sock.send(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        raw = _trickle_until_closed(sock, b"X-Slow: 1\r\n")
    status, message = _status_and_error(raw)
    assert status == 408 and "request head" in message and "--request-read-timeout" in message
    assert generate(guarded, 4).status_code == 200


def test_trickled_body_gets_408_and_is_closed(guarded: RunningServer) -> None:
    auth = f"Authorization: Bearer {guarded.api_key}\r\n".encode()
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\n" + auth
    head += b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    with _connect(guarded) as sock:
        sock.send(head)
        raw = _trickle_until_closed(sock, b" ")
    status, message = _status_and_error(raw)
    assert status == 408 and "request body" in message, raw[:300]
    assert generate(guarded, 4).status_code == 200


def test_idle_connection_is_closed_quietly(guarded: RunningServer) -> None:
    with _connect(guarded) as sock:
        assert sock.recv(65536) == b""  # closed with nothing sent: no stray 408


def test_keep_alive_connection_serves_after_a_pause_shorter_than_the_timeout(
    guarded: RunningServer,
) -> None:
    with httpx.Client(base_url=guarded.url, headers=guarded.headers, timeout=60) as client:
        assert client.get("/v1/models").status_code == 200
        time.sleep(READ_TIMEOUT_S / 4)
        assert client.get("/v1/models").status_code == 200


def test_other_clients_are_served_during_a_slowloris(guarded: RunningServer) -> None:
    sockets = [_connect(guarded) for _ in range(20)]
    try:
        for sock in sockets:
            sock.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # heads that never end
        r = generate(guarded, 4)
        assert r.status_code == 200, r.text
    finally:
        for sock in sockets:
            sock.close()


def test_read_timeout_is_documented() -> None:
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings}
    text = helps["--request-read-timeout"]
    assert "slowloris" in text.lower() and "408" in text
    limits_page = (Path(__file__).parents[2] / "docs" / "hardening.md").read_text()
    assert "--request-read-timeout" in limits_page
