"""How the speech server says no: OpenAI's error body for invalid requests, HTTP errors, a gone engine and
anything unexpected (never a traceback; its connection closed), the API key check, and the request body's cap
and deadline. Each refusal is counted in ``/metrics`` under its route's template."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving.client import EngineGoneError
from .metrics import Metrics, route_label
from .schema import error
from .timeouts import within

UPLOAD_ROUTE = ("POST", "/v1/audio/voices")
"""The one route whose body is a file (multipart): it has the upload cap, every other the body cap."""

logger = logging.getLogger(__name__)


class BodyTooLargeError(StarletteHTTPException):
    """A request body past its cap (raised while the app reads it: before any JSON is parsed)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes")
        self.limit = limit


class BodyTimeoutError(StarletteHTTPException):
    """A request body that did not arrive within its deadline (raised while the app reads it)."""

    def __init__(self, timeout_s: float):
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s")


def too_large(limit: int) -> Response:
    """The 413 of a body past ``limit`` bytes; the connection closes, as the rest of the body is never read."""
    return error(413, f"the request body is larger than {limit} bytes", code="request_too_large",
                 headers={"Connection": "close"})


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Answer every error of ``app`` with OpenAI's error body, counted in ``metrics``."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":  # the location is a character offset, not a field
            loc = []
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        metrics.count(route_label(request.scope), 400)
        return error(400, message, param=loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        metrics.count(route_label(request.scope), exc.status_code)
        return error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(EngineGoneError)
    async def _gone(request: Request, exc: EngineGoneError) -> Response:
        metrics.count(route_label(request.scope), 503)
        return error(503, str(exc), "server_error")

    @app.exception_handler(BodyTooLargeError)
    async def _too_large(request: Request, exc: BodyTooLargeError) -> Response:
        metrics.count(route_label(request.scope), 413)
        return too_large(exc.limit)

    @app.exception_handler(BodyTimeoutError)
    async def _too_slow(request: Request, exc: BodyTimeoutError) -> Response:
        metrics.count(route_label(request.scope), 408)
        return error(408, str(exc.detail), code="request_timeout", headers={"Connection": "close"})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        metrics.count(route_label(request.scope), 500)
        # the connection may be mid-body or mid-response: the client must not send its next request down it
        return error(500, "internal error: the server log has the details", "server_error",
                     headers={"Connection": "close"})


class ApiKeyAuth:
    """``Authorization: Bearer KEY`` on ``/v1/`` routes, else 401. A plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` re-streams every body and ends it cleanly even when the app raised mid-stream, so a
    failed audio stream would look complete to the client."""

    def __init__(self, app, key: str, metrics: Metrics):
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            if dict(scope["headers"]).get(b"authorization", b"") != self.expected:
                self.metrics.count(route_label(scope), 401)
                response = error(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """At most ``max_body`` bytes of request body (``max_upload`` for a voice upload), else 413: at once when
    ``Content-Length`` says more, and as soon as a chunked body passes the cap, reading no further. The whole
    body within ``timeout_s`` of the headers, else 408. A plain ASGI middleware, like ``ApiKeyAuth``."""

    def __init__(self, app, max_body: int, max_upload: int, metrics: Metrics, timeout_s: float = 60.0):
        self.app, self.max_body, self.max_upload, self.metrics = app, max_body, max_upload, metrics
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_upload if (scope["method"], scope["path"]) == UPLOAD_ROUTE else self.max_body
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > limit):
            self.metrics.count(route_label(scope), 413)
            await too_large(limit)(scope, receive, send)
            return
        seen, started, complete = 0, False, False
        deadline = time.monotonic() + self.timeout_s

        async def capped_receive():
            nonlocal seen, complete
            if complete:  # the body is in: what follows is the wait for a disconnect, which has no deadline
                return await receive()
            try:
                message = await within(receive(), deadline - time.monotonic())
            except TimeoutError:
                raise BodyTimeoutError(self.timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLargeError(limit)
                complete = not message.get("more_body", False)
            return message

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped_receive, watched_send)
        except BodyTooLargeError:  # a route that read its body outside FastAPI's handlers
            if started:
                raise
            self.metrics.count(route_label(scope), 413)
            await too_large(limit)(scope, receive, send)
        except BodyTimeoutError as e:
            if started:
                raise
            self.metrics.count(route_label(scope), 408)
            await error(408, str(e.detail), code="request_timeout", headers={"Connection": "close"})(
                scope, receive, send)
