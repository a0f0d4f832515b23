"""The bootstrap fields a PD router injects: one room per engine request, derived alike on both
servers (entrypoints/bootstrap.py), and a clear 400 for bad values on every route."""

from __future__ import annotations

from typing import Any

import pytest
import requests
from server_process import RunningServer

from radixserve.core.disaggregation import DEFAULT_BOOTSTRAP_PORT, Bootstrap
from radixserve.core.request import InvalidRequest
from radixserve.entrypoints.bootstrap import expand_bootstrap


def rooms(room: Any, counts: list[int]) -> list[int]:
    out = expand_bootstrap("10.0.0.1", 8998, room, counts)
    return [b.room for b in out if b is not None]


def test_rooms_per_engine_request() -> None:
    assert rooms(7, [1]) == [7]
    assert rooms(7, [2, 3]) == [7, 8, 9, 10, 11]  # one room: room + k
    assert rooms([100, 200], [2, 1]) == [100, 101, 200]  # one per prompt: room[j] + i
    assert rooms([5, 9, 4], [2, 1]) == [5, 9, 4]  # one per request: as given
    assert rooms(2**64 - 1, [2]) == [2**64 - 1, 0]  # wraps within 64 bits


def test_hosts_and_ports() -> None:
    out = expand_bootstrap(["a", "b"], [None, 9000], 1, [1, 2])
    assert out == [
        Bootstrap(host="a", port=DEFAULT_BOOTSTRAP_PORT, room=1),
        Bootstrap(host="b", port=9000, room=2),
        Bootstrap(host="b", port=9000, room=3),
    ]
    assert expand_bootstrap("a", 1, None, [2]) == [None, None]  # no room: runs whole


@pytest.mark.parametrize(
    ("host", "port", "room", "match"),
    [
        ("h", 1, -1, "bootstrap_room must be an integer"),
        ("h", 1, 2**64, "bootstrap_room must be an integer"),
        ("h", 1, "3", "bootstrap_room must be an integer"),
        ("h", 1, True, "bootstrap_room must be an integer"),
        ("h", 1, [1, 2, 3, 4], "bootstrap_room has 4 entries"),
        (None, 1, 3, "bootstrap_room needs bootstrap_host"),
        ("", 1, 3, "bootstrap_host must be"),
        ("h\n", 1, 3, "bootstrap_host must be"),
        ("h", 0, 3, "bootstrap_port must be a TCP port"),
        ("h", 70000, 3, "bootstrap_port must be a TCP port"),
        ("h", [1, 2, 3, 4], 3, "bootstrap_port has 4 entries"),
        ("h", "x", None, "bootstrap_port must be a TCP port"),
    ],
)
def test_bad_values(host: Any, port: Any, room: Any, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        expand_bootstrap(host, port, room, [2, 1])


def test_routes_accept_and_check_the_fields(server: RunningServer) -> None:
    """A server without --disaggregation-mode takes the router's fields and runs the request
    whole; bad values are a 400 naming the field on each route."""
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}
    bad = {**fields, "bootstrap_room": -5}
    native = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"model": "m", "prompt": "hi", "max_tokens": 2}
    for path, body in (("/generate", native), ("/v1/chat/completions", chat),
                       ("/v1/completions", comp)):  # fmt: skip
        ok = requests.post(server.url + path, json={**body, **fields}, headers=server.headers,
                           timeout=60)  # fmt: skip
        assert ok.status_code == 200, (path, ok.text)
        refused = requests.post(server.url + path, json={**body, **bad}, headers=server.headers,
                                timeout=60)  # fmt: skip
        assert refused.status_code == 400, (path, refused.text)
        assert "bootstrap_room" in refused.text
