"""How the speech server says no: OpenAI's error body for invalid requests, HTTP errors, a gone engine and
anything unexpected (never a traceback), and the API key check. Each refusal is counted in ``/metrics``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving.client import EngineGoneError
from .metrics import Metrics
from .schema import error

logger = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Answer every error of ``app`` with OpenAI's error body, counted in ``metrics``."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":  # the location is a character offset, not a field
            loc = []
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        metrics.count(request.url.path, 400)
        return error(400, message, param=loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        metrics.count(request.url.path, exc.status_code)
        return error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(EngineGoneError)
    async def _gone(request: Request, exc: EngineGoneError) -> Response:
        metrics.count(request.url.path, 503)
        return error(503, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        metrics.count(request.url.path, 500)
        return error(500, "internal error: the server log has the details", "server_error")


class ApiKeyAuth:
    """``Authorization: Bearer KEY`` on ``/v1/`` routes, else 401. A plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` re-streams every body and ends it cleanly even when the app raised mid-stream, so a
    failed audio stream would look complete to the client."""

    def __init__(self, app, key: str, metrics: Metrics):
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            if dict(scope["headers"]).get(b"authorization", b"") != self.expected:
                self.metrics.count(scope["path"], 401)
                response = error(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
