"""Errors as OpenAI error objects, and the ASGI guard (API keys, admin routes, body size) in
front of the app.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
or 5xx status (the Anthropic Messages routes answer in Anthropic's shape instead,
``{"type": "error", "error": {"type", "message"}}``); pydantic validation failures become a
readable 400, not a 422 dump. An exception no handler knows is a JSON 500 too
(GuardMiddleware), and the connection stays usable for the client's next request.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.core.request import InvalidRequest
from radixserve.entrypoints.admission import Overloaded
from radixserve.entrypoints.engine_client import EngineDied
from radixserve.entrypoints.tokenizer_manager import ClientGone

logger = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
# No key needed to ask whether the server is up, or for Prometheus scrapes.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


class ApiError(Exception):
    """Raised by handlers: becomes an error response with this status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def is_client_error(exc: BaseException) -> bool:
    """Whether ``exc`` makes a 4xx answer (the request's fault) rather than a 5xx (the
    server's: overloaded, its engine gone, a bug), which a client or router may retry."""
    if isinstance(exc, ApiError):
        return exc.status < 500
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code < 500
    return isinstance(exc, InvalidRequest | RequestValidationError)


def error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")
    # A message may quote the client's text, lone surrogates included; keep it encodable.
    message = message.encode("utf-8", "backslashreplace").decode()
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
#: Routes that answer errors in Anthropic's shape (the Messages API) rather than OpenAI's.
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ANTHROPIC_TYPES.get(status) or (
        "invalid_request_error" if status < 500 else "api_error"
    )
    message = message.encode("utf-8", "backslashreplace").decode()
    return {"type": "error", "error": {"type": kind, "message": message}}


def _shaped(
    path: str, status: int, message: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The error body in the shape the route at ``path`` answers with."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    path: str = "",
) -> JSONResponse:
    return JSONResponse(_shaped(path, status, message, param, code), status_code=status)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    if not loc:  # the body itself is not an object
        return f"the request body must be a JSON object: {first.get('msg')}", None
    field = ".".join(loc)
    msg = f"{field}: {first.get('msg')}"
    if first.get("type") != "missing" and "input" in first:
        msg += f" (got {json.dumps(first['input'], default=str)[:200]})"
    return msg, field


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return error_response(400, message, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = "no such route; see /v1/models, /generate and /get_server_info"
        return error_response(exc.status_code, message, path=request.url.path)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, request.url.path)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> JSONResponse:
        return error_response(400, str(exc), exc.param, path=request.url.path)

    @app.exception_handler(EngineDied)
    async def _dead(request: Request, exc: EngineDied) -> JSONResponse:
        message = f"the engine is not running: {exc}"
        return error_response(503, message, path=request.url.path)

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        response = error_response(503, str(exc), code="overloaded", path=request.url.path)
        response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> JSONResponse:
        message = "the client disconnected; the request was aborted"
        return error_response(499, message, path=request.url.path)


class GuardMiddleware:
    """Pure ASGI (streaming and disconnect detection stay intact): checks the API keys with a
    constant-time compare and caps the header and body sizes. (uvicorn's h11 limit only bounds
    a head still arriving; one read in a single chunk is checked here.) It also answers any
    exception no handler took with a JSON 500, instead of Starlette's text/plain one that
    re-raises and makes uvicorn drop the connection.

    ``admin_paths`` (the routes that change the server's state) need ``admin_key`` where one is
    set, from any address; without one they answer only loopback clients, which must still
    send ``api_key`` where one is set. Every other route but PUBLIC_PATHS needs ``api_key``
    where one is set (the admin key is taken there too)."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        max_header_bytes: int = 64 << 10,
        admin_key: str | None = None,
        admin_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.admin_expected = f"Bearer {admin_key}".encode() if admin_key else None
        self.admin_paths = admin_paths
        self.max_body = max_body_bytes
        self.max_header = max_header_bytes

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        """(status, message) where the caller may not use this path, else None."""
        path = scope["path"]
        got = headers.get(b"authorization", b"")
        if not got and b"x-api-key" in headers:  # Anthropic's clients send the key so
            got = b"Bearer " + headers[b"x-api-key"]
        if path in self.admin_paths:
            if self.admin_expected is not None:
                if hmac.compare_digest(got, self.admin_expected):
                    return None
                return 401, "invalid or missing admin API key; send 'Authorization: Bearer <key>'"
            if not _is_loopback(scope.get("client")):
                return 403, (
                    f"{path} answers only loopback clients; start the server with "
                    "--admin-api-key to allow it from other addresses"
                )
        elif path in PUBLIC_PATHS:
            return None
        if self.expected is None or hmac.compare_digest(got, self.expected):
            return None
        if self.admin_expected is not None and path not in self.admin_paths:
            if hmac.compare_digest(got, self.admin_expected):
                return None
        return 401, "invalid or missing API key; send 'Authorization: Bearer <key>'"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_headers = scope.get("headers") or []
        size = sum(len(k) + len(v) + 4 for k, v in raw_headers)
        if size > self.max_header:
            msg = f"the request headers ({size} bytes) exceed the limit of {self.max_header} bytes"
            await _send(send, 431, _shaped(scope["path"], 431, msg))
            return
        headers = dict(raw_headers)
        refused = self._refusal(scope, headers)
        if refused is not None:
            status, msg = refused
            code = "invalid_api_key" if status == 401 else "admin_route"
            await _send(send, status, _shaped(scope["path"], status, msg, code=code))
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _send(send, 413, self._too_large(scope["path"]))
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    # Raised inside the app, whose handler turns it into the error object.
                    raise StarletteHTTPException(413, self._too_large_message())
            return message

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except ClientDisconnect:
            return  # nobody to answer
        except Exception as e:
            if started:
                raise  # a response half sent: only closing the connection can end it
            logger.exception("unhandled error on %s %s", scope.get("method"), scope["path"])
            msg = f"internal server error ({type(e).__name__}); the request was not completed"
            await _send(send, 500, _shaped(scope["path"], 500, msg))

    def _too_large_message(self) -> str:
        return f"the request body exceeds the limit of {self.max_body} bytes"

    def _too_large(self, path: str) -> dict[str, Any]:
        return _shaped(path, 413, self._too_large_message())


def _is_loopback(client: Any) -> bool:
    """Whether the ASGI ``client`` (host, port) is on this machine's loopback interface."""
    if not client:
        return False  # a Unix socket or an unknown peer: not known to be local
    try:
        ip = ipaddress.ip_address(str(client[0]).split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


async def _send(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
