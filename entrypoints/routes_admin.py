"""Admin routes, which change the server's state: cache flush, abort, weight reload, profiling.

GuardMiddleware gates every path of ADMIN_PATHS: with --admin-api-key they need that key; without
one they answer only clients on the loopback interface (and need --api-key where one is set).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from radixserve.core.request import InvalidRequest
from radixserve.entrypoints.http_errors import error_response
from radixserve.entrypoints.http_json import read_object
from radixserve.entrypoints.profiling import ProfileDir, start_profile, stop_profile
from radixserve.entrypoints.serving_lora import LORA_PATHS, add_lora_routes
from radixserve.entrypoints.serving_weights import add_weight_routes
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

GET_POST = ["GET", "POST"]
ADMIN_PATHS = frozenset(
    {"/flush_cache", "/clear_hicache_storage_backend", "/abort_request",
     "/update_weights_from_disk", "/start_profile", "/stop_profile"} | LORA_PATHS
)  # fmt: skip


def add_admin_routes(app: FastAPI, tm: TokenizerManager, profile_dir: ProfileDir) -> None:
    add_weight_routes(app, tm)
    add_lora_routes(app, tm)

    @app.api_route("/flush_cache", methods=GET_POST)
    async def flush_cache() -> Any:
        if not await tm.flush_cache():
            return error_response(400, "cache not flushed: requests are running; retry when idle")
        return {"success": True, "message": "cache flushed"}

    @app.api_route("/clear_hicache_storage_backend", methods=GET_POST)
    async def clear_hicache_storage_backend() -> Any:
        if not await tm.flush_cache(storage=True):
            return error_response(
                400,
                "storage not cleared: requests are running, or no --hicache-storage-backend "
                "is set (or it failed; see the server log)",
            )
        return {"success": True, "message": "hierarchical cache storage cleared"}

    @app.post("/abort_request")
    async def abort_request(raw: Request) -> Any:
        body = await read_object(raw)
        abort_all = body.get("abort_all")
        if abort_all is not None and not isinstance(abort_all, bool):
            raise InvalidRequest(f"abort_all must be true or false, got {abort_all!r:.200}")
        if abort_all:
            tm.abort_all()
        elif isinstance(body.get("rid"), str):
            tm.abort(body["rid"])
        else:
            raise InvalidRequest("send {'rid': <request id>} or {'abort_all': true}")
        return {"success": True}

    @app.api_route("/start_profile", methods=GET_POST)
    async def start_profile_route(raw: Request) -> Any:
        return await start_profile(tm, await read_object(raw), profile_dir)

    @app.api_route("/stop_profile", methods=GET_POST)
    async def stop_profile_route() -> Any:
        return await stop_profile(tm)


def admin_access(admin_api_key: str | None) -> str:
    """The start-up line that says who may call the admin routes."""
    routes = ", ".join(sorted(ADMIN_PATHS))
    if admin_api_key:
        return f"admin routes ({routes}) need --admin-api-key"
    return f"admin routes ({routes}) answer only loopback clients; --admin-api-key opens them"
