"""``GET /v1/audio/speech/stream``: the realtime socket's endpoint and its API key check.

With an API key set, a client proves it one of three ways: the ``Authorization: Bearer KEY`` header; the
subprotocol ``chattts-velocity.bearer.KEY`` (browsers cannot set a socket's headers; offer ``chattts-velocity``
beside it and the server answers with that one rather than echo the key); or ``{"type": "auth", "api_key":
KEY}`` as the first message. A wrong or missing key gets an ``invalid_api_key`` error event, then close 1008.
The app's ``ApiKeyAuth`` middleware checks HTTP requests only: this check is the socket's. The key is never
logged."""

from __future__ import annotations

import contextlib
import hmac

from fastapi import FastAPI
from starlette.websockets import WebSocket, WebSocketDisconnect

from .protocol import Auth, ProtocolError, parse
from .session import Session, within

PATH = "/v1/audio/speech/stream"
SUBPROTOCOL = "chattts-velocity"
"""The subprotocol the server answers with when a client offers it."""
KEY_SUBPROTOCOL = "chattts-velocity.bearer."
"""Prefix of the subprotocol that carries the API key."""


def install_realtime(app: FastAPI, state) -> None:
    """Serve the realtime socket on ``app`` over ``state`` (the app's ``SpeechState``)."""

    @app.websocket(PATH)
    async def speech_stream(ws: WebSocket) -> None:
        await serve_socket(ws, state)


async def serve_socket(ws: WebSocket, state) -> None:
    """Accept ``ws``, check its key, and run its session; counted in ``/metrics`` by how it ended."""
    offered = list(ws.scope.get("subprotocols") or ())
    await ws.accept(subprotocol=_answer(offered))
    metrics = state.metrics
    metrics.ws_sockets.inc()
    reason = "error"
    try:
        reason = await _authenticate(ws, state, _given_key(ws, offered))
        if reason is None:
            reason = await Session(ws, state).run()
    finally:
        metrics.ws_sockets.dec()
        metrics.count(PATH, reason)


def _answer(offered: list[str]) -> str | None:
    """The subprotocol to accept with: ours if offered, else the key's (a browser fails a handshake whose
    answer is none of those it offered), else none."""
    if SUBPROTOCOL in offered:
        return SUBPROTOCOL
    return next((p for p in offered if p.startswith(KEY_SUBPROTOCOL)), None)


def _given_key(ws: WebSocket, offered: list[str]) -> str | None:
    """The key the handshake carries (the header, else a subprotocol), or None."""
    header = ws.headers.get("authorization")
    if header is not None:
        scheme, _, key = header.partition(" ")
        return key.strip() if scheme.lower() == "bearer" else ""
    return next((p[len(KEY_SUBPROTOCOL):] for p in offered if p.startswith(KEY_SUBPROTOCOL)), None)


async def _authenticate(ws: WebSocket, state, given: str | None) -> str | None:
    """None if the client may go on (no key is set, or it gave the key); else why the socket ended (its
    client told why, and the socket closed)."""
    expected = state.config.api_key
    if not expected:
        return None
    if given is None:
        try:
            frame = await within(ws.receive(), state.config.ws_idle_timeout_s)
        except TimeoutError:
            frame = {"type": "websocket.receive", "text": None}
        if frame["type"] == "websocket.disconnect":
            return "disconnected"
        with contextlib.suppress(ProtocolError):
            message = parse(frame.get("text"))
            given = message.api_key if isinstance(message, Auth) else None
    if given is not None and hmac.compare_digest(given.encode(), expected.encode()):
        return None
    refusal = ProtocolError("invalid_api_key", "invalid or missing API key: send 'Authorization: Bearer <key>', "
                            f"the subprotocol '{KEY_SUBPROTOCOL}<key>' or a first message "
                            '{"type": "auth", "api_key": "<key>"}')
    with contextlib.suppress(TimeoutError, WebSocketDisconnect, RuntimeError):
        await within(ws.send_json(refusal.event()), state.config.ws_send_timeout_s)
        await within(ws.close(1008), state.config.ws_send_timeout_s)
    return "invalid_api_key"
