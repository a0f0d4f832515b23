"""The fields of agent traffic that /generate and the OpenAI routes take: ``priority``
(core/priority.py) and ``session_params`` (core/sessions.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from radixserve.core.request import InvalidRequest
from radixserve.core.sessions import SessionParams

_SESSION_KEYS = ("id", "rid", "offset", "replace", "drop_previous_output")
# On the OpenAI routes the prompt is the whole conversation: a session only keeps it pinned.
_GENERATE_ONLY = ("rid", "offset", "drop_previous_output")


@dataclass(frozen=True, slots=True)
class RouteExtras:
    """What a request carries for the scheduler beside its prompt and sampling."""

    priority: int = 0
    session: SessionParams | None = None
    labels: dict[str, str] | None = None  # SGLang's custom_labels (metrics_spec.py's group)


def route_extras(
    priority: Any, session_params: Any, append: bool, custom_labels: Any = None
) -> RouteExtras:
    """Check the request's ``priority``, ``session_params`` (``append``: /generate, whose
    tokens follow the session's context; else an OpenAI route) and ``custom_labels``."""
    extras = _route_extras(priority, session_params, append)
    return dataclasses.replace(extras, labels=_custom_labels(custom_labels))


def _custom_labels(value: Any) -> dict[str, str] | None:
    """SGLang's ``custom_labels``: an object of short strings (at most 8)."""
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= 8
    ok = ok and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 64
        for k, v in value.items()
    )
    if not ok:
        raise InvalidRequest(
            f"custom_labels must be an object of at most 8 strings of at most 64 characters, "
            f"got {value!r:.100}",
            "custom_labels",
        )
    return dict(value)


def _route_extras(priority: Any, session_params: Any, append: bool) -> RouteExtras:
    if priority is None:
        priority = 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequest(f"priority must be an integer, got {priority!r:.100}", "priority")
    if session_params is None:
        return RouteExtras(priority)
    return RouteExtras(priority, _session_params(session_params, append))


def _session_params(value: Any, append: bool) -> SessionParams:
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"session_params must be an object with the session's 'id', got {value!r:.100}",
            "session_params",
        )
    unknown = sorted(set(value) - set(_SESSION_KEYS))
    if unknown:
        raise InvalidRequest(
            f"session_params has unknown field(s) {unknown}; known: {list(_SESSION_KEYS)}",
            "session_params",
        )
    if not append:
        given = [k for k in _GENERATE_ONLY if value.get(k) not in (None, False)]
        if given:
            raise InvalidRequest(
                f"session_params.{given[0]} applies to /generate only: the OpenAI routes send "
                "the whole conversation, which the session keeps cached",
                "session_params",
            )
    sid, rid, offset = value.get("id"), value.get("rid"), value.get("offset")
    if not isinstance(sid, str) or not sid:
        raise InvalidRequest(f"session_params.id must be a session id, got {sid!r:.100}")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequest(f"session_params.rid must be a string, got {rid!r:.100}")
    if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool)):
        raise InvalidRequest(f"session_params.offset must be an integer, got {offset!r:.100}")
    flags = {k: value.get(k, False) for k in ("replace", "drop_previous_output")}
    for key, flag in flags.items():
        if not isinstance(flag, bool):
            raise InvalidRequest(f"session_params.{key} must be true or false, got {flag!r:.100}")
    return SessionParams(sid, rid, offset, append=append, **flags)
