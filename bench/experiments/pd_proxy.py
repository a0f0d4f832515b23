#!/usr/bin/env python
"""A minimal prefill/decode router for benchmarks, where sglang-router cannot travel (its wheel
is 30.7 MB): it sends each request as sglang-router 0.3.2 does in PD mode (../shared/ROUTER.md,
section 4): the same body, plus ``bootstrap_host``, ``bootstrap_port`` and one random
``bootstrap_room``, to the same route on the prefill and the decode server at the same time,
and answers with the decode's response, streamed as it comes; the prefill's is read and
dropped (a failed one is counted in ``GET /pd_stats``). Without ``--prefill`` it forwards to
one server unchanged, so that a colocated server is measured behind the same hop.

    python bench/pd_proxy.py --port 31000 --decode http://127.0.0.1:30002 \
        --prefill http://127.0.0.1:30001 --bootstrap-port 8998

GET routes (``/get_model_info``, ``/health`` ...) go to the decode (or the one) server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

POST_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def create_app(decode: str, prefill: str | None = None, bootstrap_port: int | None = None) -> Any:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits)
    host = urlsplit(prefill).hostname if prefill else None
    stats: dict[str, Any] = {"requests": 0, "prefill_failed": 0, "prefill_errors": []}
    pending: set[asyncio.Task[None]] = set()  # prefill calls in flight (kept referenced)

    async def call_prefill(path: str, body: dict[str, Any]) -> None:
        assert prefill is not None
        try:
            resp = await client.post(prefill + path, json=body)
            error = None if resp.is_success else f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            stats["prefill_failed"] += 1
            if len(stats["prefill_errors"]) < 5:
                stats["prefill_errors"].append(error)

    async def forward(request: Request) -> Response:
        body = await request.json()
        stats["requests"] += 1
        path = request.url.path
        if prefill is not None:
            room = random.getrandbits(63)
            body = {**body, "bootstrap_host": host, "bootstrap_port": bootstrap_port,
                    "bootstrap_room": room}  # fmt: skip
            task = asyncio.create_task(call_prefill(path, body))
            pending.add(task)
            task.add_done_callback(pending.discard)
        call = client.build_request("POST", decode + path, json=body)
        resp = await client.send(call, stream=True)
        return StreamingResponse(
            resp.aiter_raw(),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type"),
            background=BackgroundTask(resp.aclose),
        )

    async def get(request: Request) -> Response:
        resp = await client.get(decode + request.url.path)
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    async def pd_stats(request: Request) -> Response:
        return JSONResponse({**stats, "prefill_in_flight": len(pending)})

    routes = [Route(path, forward, methods=["POST"]) for path in POST_ROUTES]
    routes += [Route("/pd_stats", pd_stats), Route("/{path:path}", get, methods=["GET"])]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--decode", required=True, help="decode server URL (or the one server's)")
    p.add_argument("--prefill", default=None, help="prefill server URL: PD mode")
    p.add_argument("--bootstrap-port", type=int, default=None, help="the prefill's")
    args = p.parse_args(argv)
    app = create_app(args.decode.rstrip("/"), args.prefill and args.prefill.rstrip("/"),
                     args.bootstrap_port)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
