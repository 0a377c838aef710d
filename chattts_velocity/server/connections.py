"""Connection limits uvicorn does not set: a deadline for a request's headers (a client that opens a connection
and sends nothing, or a byte now and then, gets 408 and is closed) and a cap on open connections (one past it is
answered 503 and closed at once, before it costs anything). The body's own deadline is ``errors.BodyLimit``'s.

``protocol_class(base, config)`` is uvicorn's HTTP protocol (httptools' or h11's) with both: it hooks only the
asyncio ``Protocol`` methods and reads ``cycle`` (uvicorn's request in progress, made once a request's headers
are in) and ``connections`` (every open connection of the server)."""

from __future__ import annotations

import asyncio
import json

from .settings import ServerConfig


def _response(status: int, reason: str, message: str, kind: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


def protocol_class(base: type, config: ServerConfig) -> type:
    """``base`` (a uvicorn HTTP protocol class) with ``config``'s header deadline and connection cap."""
    timeout = _response(408, "Request Timeout", f"the request's headers did not arrive within "
                        f"{config.header_timeout_s:g} s", "invalid_request_error", "request_timeout")
    full = _response(503, "Service Unavailable", f"the server has {config.max_connections} connections open, "
                     "its most: try again later", "server_error", "too_many_connections")

    class Limited(base):
        header_timeout_s = config.header_timeout_s
        max_connections = config.max_connections

        def connection_made(self, transport: asyncio.Transport) -> None:
            self._deadline: asyncio.TimerHandle | None = None
            self._seen = None  # the request (``cycle``) whose headers were last in
            super().connection_made(transport)
            if len(self.connections) > self.max_connections:
                transport.write(full)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or a WebSocket
                self._disarm()
            elif self.cycle is not self._seen:  # a new request's headers are in: the app has it now
                self._seen = self.cycle
                self._disarm()
            elif self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the next request began on a kept-alive connection, its headers not all in

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = asyncio.get_running_loop().call_later(self.header_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self) -> None:
            self._deadline = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.write(timeout)
                self.transport.close()

    Limited.__name__ = Limited.__qualname__ = f"Limited{base.__name__}"
    return Limited


def uvicorn_protocol(config: ServerConfig) -> type:
    """The HTTP protocol class uvicorn's ``http="auto"`` would take (httptools', else h11's), with limits."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools is optional in uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return protocol_class(base, config)
