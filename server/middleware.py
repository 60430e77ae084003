"""Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and hide disconnects)."""

import hmac
import logging
import math
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .http_errors import error_response
from .metrics import Metrics

access_log = logging.getLogger("server.access")
error_log = logging.getLogger("server.errors")

REQUEST_ID_HEADER = "x-request-id"
# When the client (or a proxy in front) sent the request, as nginx writes it: "t=<epoch seconds>".
REQUEST_START_HEADER = "x-request-start"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
QUIET_PATHS = frozenset({"/health", "/metrics"})     # probes and scrapes: access-logged at debug


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_start(value: str) -> float | None:
    """The epoch seconds of an ``X-Request-Start: t=<seconds>`` header; None if absent or not that."""
    try:
        start = float(value.removeprefix("t="))
    except ValueError:
        return None
    return start if math.isfinite(start) and start > 0 else None


class RequestContextMiddleware:
    """Echoes a sane X-Request-Id or generates one, stores it in ``request.state.request_id``,
    counts the response and writes one access-log line with the request's duration."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        supplied = headers.get(REQUEST_ID_HEADER, "")
        request_id = supplied if _VALID_REQUEST_ID.match(supplied) else new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["request_start"] = request_start(headers.get(REQUEST_START_HEADER, ""))
        started = time.perf_counter()
        status = 500
        sent_start = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent_start
            if message["type"] == "http.response.start":
                sent_start = True
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if sent_start:      # too late for an error response: the connection just closes
                raise
            error_log.error("unhandled error", exc_info=True,
                            extra={"fields": {"request_id": request_id, "path": scope["path"]}})
            await error_response(scope["path"], 500, "internal server error")(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            route_path = getattr(route, "path", None) or "unmatched"
            self.metrics.http_requests.labels(method=scope["method"], route=route_path,
                                              status=str(status)).inc()
            client = scope.get("client")
            level = logging.DEBUG if scope["path"] in QUIET_PATHS and status < 400 else logging.INFO
            access_log.log(level, "request", extra={"fields": {
                "request_id": request_id, "method": scope["method"], "path": scope["path"],
                "status": status, "duration_s": round(time.perf_counter() - started, 6),
                "client": f"{client[0]}:{client[1]}" if client else None}})


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every path except the open ones."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = frozenset({"/health"})):
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.expected):
            await self.app(scope, receive, send)
            return
        response = error_response(scope["path"], 401, "missing or invalid API key (Authorization: Bearer <key>)",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over ``max_bytes``: at once when Content-Length says so, else as
    soon as the bytes read pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(scope["path"], 413, f"the request body has {declared} bytes, "
                                                          f"over the limit of {self.max_bytes}")
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, f"the request body is over the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)
