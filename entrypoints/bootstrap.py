"""The bootstrap fields a prefill/decode router injects (``bootstrap_host``,
``bootstrap_port``, ``bootstrap_room``), read into one ``Bootstrap`` per engine request.

sglang-router sends the same body, with the same room, to a prefill and a decode server; for
a batch (several prompts, or a chat with n > 1) the fields are parallel arrays. Both servers
must derive the same room for each engine request, so the rules are fixed (as SGLang's):
a single room serves request k of the call as ``room + k``; a list with one room per prompt
gives choice i of prompt j ``room[j] + i``; a list with one room per engine request is used
as it is. A host or port given once applies to all; a null port means SGLang's default 8998.
"""

from __future__ import annotations

from typing import Any

from radixserve.core.disaggregation import DEFAULT_BOOTSTRAP_PORT, Bootstrap
from radixserve.core.request import InvalidRequest

ROOM_LIMIT = 1 << 64  # rooms are unsigned 64-bit integers (sglang-router draws < 2**63)


def expand_bootstrap(host: Any, port: Any, room: Any, counts: list[int]) -> list[Bootstrap | None]:
    """One Bootstrap (or None: no room given) per engine request, in submission order;
    ``counts[j]`` is how many engine requests prompt j makes (its n)."""
    total = sum(counts)
    if room is None:
        _per_request(host, counts, "bootstrap_host", _check_host)  # still checked
        _per_request(port, counts, "bootstrap_port", _check_port)
        return [None] * total
    rooms = _rooms(room, counts)
    hosts = _per_request(host, counts, "bootstrap_host", _check_host)
    ports = _per_request(port, counts, "bootstrap_port", _check_port)
    out: list[Bootstrap | None] = []
    for h, p, r in zip(hosts, ports, rooms, strict=True):
        if h is None:
            raise InvalidRequest("bootstrap_room needs bootstrap_host (the prefill server's host)")
        out.append(Bootstrap(host=h, port=DEFAULT_BOOTSTRAP_PORT if p is None else p, room=r))
    return out


def _rooms(value: Any, counts: list[int]) -> list[int]:
    total = sum(counts)
    if not isinstance(value, list):
        start = _check_room(value)
        return [(start + k) % ROOM_LIMIT for k in range(total)]
    rooms = [_check_room(v) for v in value]
    if len(rooms) == total:
        return rooms
    if len(rooms) == len(counts):
        return [(r + i) % ROOM_LIMIT for r, n in zip(rooms, counts, strict=True) for i in range(n)]
    raise InvalidRequest(
        f"bootstrap_room has {len(rooms)} entries; give one room, one per prompt "
        f"({len(counts)}) or one per request ({total})"
    )


def _per_request(value: Any, counts: list[int], name: str, check: Any) -> list[Any]:
    total = sum(counts)
    if not isinstance(value, list):
        return [check(value, name)] * total
    values = [check(v, name) for v in value]
    if len(values) == total:
        return values
    if len(values) == len(counts):
        return [v for v, n in zip(values, counts, strict=True) for _ in range(n)]
    raise InvalidRequest(
        f"{name} has {len(values)} entries; give one value, one per prompt ({len(counts)}) "
        f"or one per request ({total})"
    )


def _check_room(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < ROOM_LIMIT:
        raise InvalidRequest(f"bootstrap_room must be an integer in [0, 2**64), got {value!r:.100}")
    return value


def _check_host(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 255 or not value.isprintable():
        raise InvalidRequest(f"{name} must be a host name or address, got {value!r:.100}")
    return value


def _check_port(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise InvalidRequest(f"{name} must be a TCP port (1-65535) or null, got {value!r:.100}")
    return value


def refused_rooms(body: Any) -> list[Bootstrap | None]:
    """The rooms of a call refused before its requests were queued, as far as they can be
    told (n unknown: one per prompt); none when the fields themselves are bad."""
    get = body.get if isinstance(body, dict) else lambda name: getattr(body, name, None)
    room = get("bootstrap_room")
    if room is None:
        return []
    counts = [1] * (len(room) if isinstance(room, list) else 1)
    try:
        return expand_bootstrap(get("bootstrap_host"), get("bootstrap_port"), room, counts)
    except InvalidRequest:
        return []
