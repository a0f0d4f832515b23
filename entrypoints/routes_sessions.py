"""SGLang's ``/open_session`` and ``/close_session`` (core/sessions.py); the fields requests
carry for them are read in entrypoints/session_fields.py."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from radixserve.core.request import InvalidRequest
from radixserve.entrypoints import ipc
from radixserve.entrypoints.http_errors import error_response
from radixserve.entrypoints.http_json import read_object
from radixserve.entrypoints.tokenizer_manager import TokenizerManager


def add_session_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/open_session")
    async def open_session(raw: Request) -> Any:
        body = await read_object(raw)
        capacity, sid = body.get("capacity_of_str_len"), body.get("session_id")
        ttl = body.get("ttl")
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool)):
            raise InvalidRequest(f"capacity_of_str_len must be an integer, got {capacity!r:.100}")
        if sid is not None and (not isinstance(sid, str) or not sid):
            raise InvalidRequest(f"session_id must be a non-empty string, got {sid!r:.100}")
        if ttl is not None and (not isinstance(ttl, int | float) or isinstance(ttl, bool)):
            raise InvalidRequest(f"ttl must be a number of seconds, got {ttl!r:.100}")
        reply = await tm.session_call(
            lambda call_id: ipc.OpenSessionRequest(
                call_id=call_id, capacity=capacity, session_id=sid, ttl=ttl
            )
        )
        if not reply.ok:
            return error_response(400, reply.message)
        return reply.session_id  # SGLang answers the id alone

    @app.post("/close_session")
    async def close_session(raw: Request) -> Any:
        sid = (await read_object(raw)).get("session_id")
        if not isinstance(sid, str) or not sid:
            raise InvalidRequest(f"session_id must be a session id, got {sid!r:.100}")
        reply = await tm.session_call(
            lambda call_id: ipc.CloseSessionRequest(call_id=call_id, session_id=sid)
        )
        if not reply.ok:
            return error_response(400, reply.message)
        return {"success": True}
