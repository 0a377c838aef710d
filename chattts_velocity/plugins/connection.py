"""The client side of the realtime socket (``GET /v1/audio/speech/stream``), shared by the framework plugins:
the socket's URL and auth, the session settings, the client frames, and ``RealtimeConnection``: one socket that
carries many contexts, the server's events sorted into each context's queue by ``context_id``
(``RemoteContext``), the client's frames sent in order by one writer task."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

STREAM_PATH = "/v1/audio/speech/stream"
API_KEY_ENV = "CHATTTS_VELOCITY_API_KEY"
"""Where a plugin finds the server's key when none is given (the server's own default)."""
RETRYABLE = frozenset({"rate_limited", "generation_failed", "connection_failed", "connection_closed"})
"""Error codes where the same text may succeed on another try."""
MAX_FRAME = 1 << 24
"""Largest server frame read, in bytes."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeechSettings:
    """A session's settings (``session.update``); None keeps the server's default."""

    voice: str | dict = "alloy"
    """A voice id of ``GET /v1/audio/voices``, or a voice object as ``POST /v1/audio/speech`` takes it."""
    seed: int | None = None
    """Fixes the sampling: the same text, voice and seed give the same audio."""
    speed: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    prompt: str | None = None
    """ChatTTS's code prompt, e.g. "[speed_5]"."""
    refine_text: bool | None = None

    def session(self) -> dict[str, Any]:
        """The ``session`` object of ``session.update``: the given fields, PCM out."""
        given = {key: value for key, value in asdict(self).items() if value is not None}
        return {**given, "response_format": "pcm"}


class RealtimeError(Exception):
    """An ``error`` event, or a socket that could not open or was lost (codes ``connection_failed``,
    ``connection_closed``)."""

    def __init__(self, code: str, message: str, context_id: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.context_id, self.retry_after_s = code, message, context_id, retry_after_s

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE

    @classmethod
    def from_event(cls, event: dict) -> RealtimeError:
        return cls(str(event.get("code")), str(event.get("message")), event.get("context_id"),
                   event.get("retry_after_s"))


def stream_url(base_url: str) -> str:
    """The socket's URL from a server's base URL (http(s):// or ws(s)://, with or without the path)."""
    url = base_url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if url.startswith(http):
            url = ws + url[len(http):]
    return url if url.endswith(STREAM_PATH) else url + STREAM_PATH


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def message(kind: str, context_id: str | None = None, **fields: Any) -> str:
    """One client frame as JSON: ``{"type": kind, "context_id": ..., **fields}`` (no id: a socket message)."""
    head: dict[str, Any] = {"type": kind} if context_id is None else {"type": kind, "context_id": context_id}
    return json.dumps({**head, **fields})


def session_update(settings: SpeechSettings) -> str:
    return message("session.update", session=settings.session())


def audio_of(event: dict) -> bytes:
    """The s16le samples of an ``audio.delta`` event."""
    return base64.b64decode(event["audio"])


class RemoteContext:
    """One context of a ``RealtimeConnection``: its client frames, and its events until it is done."""

    def __init__(self, connection: RealtimeConnection, context_id: str):
        self.id = context_id
        self._connection = connection
        self._events: asyncio.Queue[dict | RealtimeError | None] = asyncio.Queue()
        self._held = ""
        self.started = False
        """An append went out: the server knows the context."""
        self.finished = False
        """audio.done or context.cancelled came, or it was cancelled here: nothing more will come."""

    def append(self, text: str) -> None:
        """Send ``text``; blank text before the first word is held back (a context of nothing but blanks is
        never opened: it would be refused as unreadable)."""
        text, self._held = self._held + text, ""
        if not self.started and not text.strip():
            self._held = text
            return
        self.started = True
        self._connection.send(message("input_text.append", self.id, text=text))

    def flush(self) -> None:
        if self.started:
            self._connection.send(message("input_text.flush", self.id))

    def end(self) -> None:
        """No more text: the context ends after its audio; one that never started ends now."""
        if self.started:
            self._connection.send(message("input_text.end", self.id))
        else:
            self._events.put_nowait(None)

    def cancel(self) -> None:
        """Barge-in: the server drops the context's audio still to come; ``events()`` ends. A no-op once done."""
        if self.started and not self.finished:
            self._connection.send(message("context.cancel", self.id))
        self.finished = True
        self._connection.forget(self.id)
        self._events.put_nowait(None)

    def deliver(self, event: dict | RealtimeError) -> None:
        self._events.put_nowait(event)

    async def events(self) -> AsyncIterator[dict]:
        """``audio.delta`` and ``speech.segment`` events in order, then ``audio.done``; an ``error`` event (or
        the socket lost) raises ``RealtimeError``."""
        while (event := await self._events.get()) is not None:
            if isinstance(event, RealtimeError):
                raise event
            kind = event.get("type")
            if kind == "error":
                raise RealtimeError.from_event(event)
            if kind in ("audio.done", "context.cancelled"):
                self.finished = True
                self._connection.forget(self.id)
            if kind != "context.cancelled":
                yield event
            if self.finished:
                return


class RealtimeConnection:
    """One socket to the realtime route, shared by many contexts (``context()``)."""

    def __init__(self, ws: ClientConnection, settings: SpeechSettings):
        self._ws = ws
        self.settings = settings
        """The session's settings, which every context takes at its first append."""
        self._contexts: dict[str, RemoteContext] = {}
        self._outbox: asyncio.Queue[str] = asyncio.Queue()
        self._session_reply: asyncio.Future[dict] | None = None
        self._configuring = asyncio.Lock()
        self._error: RealtimeError | None = None
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._write())]

    @classmethod
    async def open(cls, url: str, api_key: str | None, settings: SpeechSettings,
                   timeout: float = 10.0) -> RealtimeConnection:
        """Connect, and set the session's settings (a refusal raises ``RealtimeError``)."""
        try:
            ws = await asyncio.wait_for(connect(url, additional_headers=auth_headers(api_key),
                                                max_size=MAX_FRAME, open_timeout=None), timeout)
        except InvalidStatus as e:
            refused = e.response.status_code in (401, 403)
            raise RealtimeError("invalid_api_key" if refused else "connection_failed", str(e)) from None
        except (OSError, asyncio.TimeoutError, WebSocketException) as e:
            raise RealtimeError("connection_failed", f"{url}: {e or type(e).__name__}") from None
        try:
            await _handshake(ws, settings, timeout)
        except BaseException:
            await ws.close()
            raise
        return cls(ws, settings)

    @property
    def closed(self) -> bool:
        return self._error is not None

    @contextlib.contextmanager
    def context(self, context_id: str) -> Iterator[RemoteContext]:
        """A new context; leaving the block before it is done cancels it."""
        ctx = RemoteContext(self, context_id)
        self._contexts[context_id] = ctx
        if self._error is not None:
            ctx.deliver(self._error)
        try:
            yield ctx
        finally:
            ctx.cancel()

    def forget(self, context_id: str) -> None:
        """Events for ``context_id`` are dropped from now on."""
        self._contexts.pop(context_id, None)

    def send(self, frame: str) -> None:
        """Queue a client frame; frames go out in the order queued (dropped once the socket is lost)."""
        if self._error is None:
            self._outbox.put_nowait(frame)

    async def configure(self, settings: SpeechSettings, timeout: float = 10.0) -> None:
        """Change the session's settings, for the contexts started after this."""
        async with self._configuring:
            if settings == self.settings:
                return
            self._session_reply = asyncio.get_running_loop().create_future()
            self.send(session_update(settings))
            reply = await asyncio.wait_for(self._session_reply, timeout)
            if reply.get("type") != "session.updated":
                raise RealtimeError.from_event(reply)
            self.settings = settings

    async def aclose(self) -> None:
        """Close the socket (the server cancels the contexts still open)."""
        with contextlib.suppress(WebSocketException, OSError):
            await self._ws.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail(RealtimeError("connection_closed", "the connection was closed"))

    async def _read(self) -> None:
        try:
            async for frame in self._ws:
                self._route(json.loads(frame))
            error = RealtimeError("connection_closed", f"the server closed the socket ({self._ws.close_code})")
        except (ConnectionClosed, ValueError) as e:
            error = RealtimeError("connection_closed", str(e))
        self._fail(error)

    async def _write(self) -> None:
        try:
            while True:
                await self._ws.send(await self._outbox.get())
        except ConnectionClosed as e:
            self._fail(RealtimeError("connection_closed", str(e)))

    def _route(self, event: dict) -> None:
        ctx = self._contexts.get(event.get("context_id"))
        reply = self._session_reply
        if ctx is not None:
            ctx.deliver(event)
        elif "context_id" not in event and reply is not None and not reply.done() \
                and event.get("type") in ("session.updated", "error"):
            reply.set_result(event)
        elif event.get("type") == "error":
            # a context already cancelled here may still draw an error (e.g. unknown_context)
            logger.debug("realtime socket error event: %s", event)

    def _fail(self, error: RealtimeError) -> None:
        if self._error is not None:
            return
        self._error = error
        for ctx in list(self._contexts.values()):
            ctx.deliver(error)
        self._contexts.clear()
        if self._session_reply is not None and not self._session_reply.done():
            self._session_reply.set_exception(error)


async def _handshake(ws: ClientConnection, settings: SpeechSettings, timeout: float) -> None:
    """Wait for ``session.created``, then set ``settings``: a refusal raises ``RealtimeError``."""
    try:
        created = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if created.get("type") != "session.created":
            raise RealtimeError.from_event(created)
        await ws.send(session_update(settings))
        reply = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    except (ConnectionClosed, asyncio.TimeoutError) as e:
        raise RealtimeError("connection_failed", f"the session did not open: {e or type(e).__name__}") from None
    if reply.get("type") != "session.updated":
        raise RealtimeError.from_event(reply)
