"""Request bodies as JSON: one decoding path with one depth limit for every route.

msgspec decodes first (fast, strict). A body it refuses but Python's json accepts (NaN, a lone
surrogate escape, a UTF-16 body) is what FastAPI's model routes parse with, so that value gets
the same depth check before any handler walks it; the routes that read the body themselves
(``read_json``) still answer such a body with a 400 naming what msgspec refused.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import msgspec
from fastapi import Request

from radixserve.entrypoints.http_errors import ApiError

logger = logging.getLogger(__name__)

MAX_JSON_DEPTH = 256  # deeper request bodies are refused (no real request nests past ~5)


class NotJson(Exception):
    """The body is not JSON to the strict parser (the message says why)."""


def decode_body(data: bytes) -> Any:
    """``data`` as JSON; an empty body is ``{}``. ApiError 400 where it nests deeper than
    MAX_JSON_DEPTH, whichever parser accepts it; NotJson where msgspec refuses it."""
    if not data.strip():
        return {}
    strict_error: str | None = None
    try:
        body = msgspec.json.decode(data)
    except RecursionError:  # msgspec stops at the interpreter's recursion limit
        _too_deep()
    except msgspec.DecodeError as e:
        strict_error = str(e)
        try:
            # NOTE: FastAPI parses model routes' bodies with Python's json, so what it accepts
            # must pass the depth check too (else pydantic or a handler recurses into it).
            body = json.loads(data)
        except RecursionError:
            _too_deep()
        except ValueError:  # not JSON to either parser (UnicodeDecodeError included)
            raise NotJson(strict_error) from None
    if _depth_exceeds(body, MAX_JSON_DEPTH):
        _too_deep()
    if strict_error is not None:
        raise NotJson(strict_error)
    return body


def _too_deep() -> Any:
    message = f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
    logger.warning("refused a request body: %s", message)  # one line, no traceback
    raise ApiError(400, message)


def _depth_exceeds(value: Any, limit: int) -> bool:
    # An explicit stack: the walk itself must not recurse.
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return False


async def read_json(request: Request) -> Any:
    """The body as JSON; an empty body is ``{}``. Invalid JSON is a 400."""
    checked = getattr(request.state, "checked_json", None)
    if checked is not None:  # refuse_deep_json decoded it already (one decode per body)
        return checked[0]
    try:
        return decode_body(await request.body())
    except NotJson as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


async def read_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object; any other JSON value is a 400."""
    body = await read_json(request)
    if not isinstance(body, dict):
        kind = "null" if body is None else type(body).__name__
        raise ApiError(400, f"the request body must be a JSON object, got {kind}")
    return body


async def refuse_deep_json(request: Request) -> None:
    """Every route's body gets the depth limit, those FastAPI parses into a model included:
    pydantic takes any depth in free-form fields (tool parameters, template arguments), which
    the handlers then walk recursively. A body that is not JSON is left to the route's own
    parser, which names what is wrong with it."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return
    try:
        body = decode_body(await request.body())
    except NotJson:
        return
    # read_json hands the route this value, not a second decode of the same bytes
    request.state.checked_json = (body,)
