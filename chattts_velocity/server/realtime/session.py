"""One realtime socket's life, once it is accepted and authenticated: its settings, its contexts (each a
``SpeechContext`` with its admission ticket and the task that sends its events), its limits, and every send.

A reader takes the client's frames one at a time and dispatches each message by its type; a bad one is
answered with an ``error`` event and the socket goes on. A context takes an admission ticket at its first
append (refused at once with ``rate_limited`` when the queue is full) and holds a running slot while it reads
its audio. Every event goes out through ``send``, which gives the client ``ws_send_timeout_s`` to take it: one
that stops reading is dropped. The socket is closed after ``ws_idle_timeout_s`` with nothing sent either way
(a speaking context sends audio well within it) unless a context waits for a running slot. However the socket
ends (``session.close``, the client gone, a timeout), every context left is cancelled, which ends its engine
requests."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from ...serving.voices import UnknownVoiceError
from ..admission import QueueFullError, Ticket
from ..audio_format import encode_all
from ..prepare import code_params
from ..timeouts import within
from .context import AudioOut, DoneOut, FailedOut, SegmentOut, SpeechContext
from .protocol import (
    DEFAULT_VOICE,
    AppendText,
    Auth,
    Cancel,
    End,
    Flush,
    ProtocolError,
    SessionClose,
    SessionUpdate,
    default_settings,
    parse,
    settings_view,
    updated_settings,
)

logger = logging.getLogger(__name__)

CLOSE_CODES = {"closed": 1000, "idle_timeout": 1000, "send_timeout": 1008, "error": 1011}
"""The close code of each way a session ends on the server's side (a client that left needs none)."""


class SocketGone(Exception):
    """The socket takes no more events: its client left or stopped reading."""


class LiveContext:
    """One open context: its ``SpeechContext``, its admission ticket, the task sending its events, the next
    ``audio.delta``'s ``seq``, and whether the client ended its input."""

    def __init__(self, context: SpeechContext, ticket: Ticket):
        self.context, self.ticket = context, ticket
        self.task: asyncio.Task | None = None
        self.seq = 0
        self.ended = False
        self.waiting = True
        """Still waiting for a running slot."""


class Session:
    def __init__(self, ws: WebSocket, state):
        """``state``: the app's ``SpeechState`` (client, config, admission, metrics)."""
        self.ws, self.state, self.config = ws, state, state.config
        self.settings = default_settings(self.config.model_name)
        self.voice = state.client.voices.resolve(DEFAULT_VOICE)
        self.contexts: dict[str, LiveContext] = {}
        self.reason: str | None = None
        """Why the session ended: closed, disconnected, idle_timeout, send_timeout, error."""
        self._send_lock = asyncio.Lock()
        self._gone = asyncio.Event()
        self._last_traffic = asyncio.get_running_loop().time()
        self._handlers = {SessionUpdate: self._update, AppendText: self._append, Flush: self._flush, End: self._end,
                          Cancel: self._cancel, SessionClose: self._close, Auth: self._auth}

    async def run(self) -> str:
        """Serve the socket until it ends; why it ended (``reason``)."""
        try:
            await self.send({"type": "session.created", "session": settings_view(self.settings)})
            await self._serve()
        except SocketGone:
            pass
        except Exception:
            logger.exception("realtime session failed")
            self.reason = self.reason or "error"
        finally:
            await self._shutdown()
        return self.reason or "disconnected"

    async def send(self, event: dict) -> None:
        """Send ``event``, or ``SocketGone`` if the client left or did not take it in ``ws_send_timeout_s``."""
        text = json.dumps(event)
        async with self._send_lock:
            if self._gone.is_set():
                raise SocketGone
            try:
                await within(self.ws.send_text(text), self.config.ws_send_timeout_s)
            except TimeoutError:
                self._drop("send_timeout")
            except WebSocketDisconnect:
                self._drop("disconnected")
        self._traffic()

    def _drop(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._gone.set()
        raise SocketGone

    async def _serve(self) -> None:
        tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch_idle()),
                 asyncio.create_task(self._gone.wait())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        for task in done:
            task.result()

    async def _read(self) -> None:
        while self.reason is None:
            frame = await self.ws.receive()
            self._traffic()
            if frame["type"] == "websocket.disconnect":
                self.reason = "disconnected"
                return
            try:
                message = parse(frame.get("text"))
                await self._handlers[type(message)](message)
            except ProtocolError as e:
                await self.send(e.event())
            self._traffic()  # a long append may have held the loop: its handling counts as traffic

    def _traffic(self) -> None:
        self._last_traffic = asyncio.get_running_loop().time()

    async def _watch_idle(self) -> None:
        timeout, loop = self.config.ws_idle_timeout_s, asyncio.get_running_loop()
        while True:
            left = self._last_traffic + timeout - loop.time()
            if left > 0:
                await asyncio.sleep(left)
            elif self._send_lock.locked() or any(live.waiting for live in self.contexts.values()):
                self._traffic()  # a send under way has a timeout of its own
            else:
                self.reason = "idle_timeout"
                await self.send(ProtocolError("idle_timeout", f"nothing sent either way for {timeout:g} s: the "
                                                              "socket closes").event())
                return

    async def _update(self, m: SessionUpdate) -> None:
        settings = updated_settings(self.settings, m.session)
        voice = self.voice
        if "voice" in m.session:
            try:
                voice = self.state.client.voices.resolve(settings.voice)
            except UnknownVoiceError as e:
                raise ProtocolError("invalid_settings", str(e), param="voice") from None
        self.settings, self.voice = settings, voice
        await self.send({"type": "session.updated", "session": settings_view(settings)})

    async def _append(self, m: AppendText) -> None:
        live = self.contexts.get(m.context_id)
        if live is None:
            live = self._open(m.context_id, m.text)
        elif live.ended:
            raise ProtocolError("context_ended", f"context {m.context_id!r} has ended: start a new context",
                                m.context_id)
        try:
            live.context.append(m.text)
        except ValueError as e:
            raise ProtocolError("text_too_long", str(e), m.context_id) from None

    def _open(self, context_id: str, text: str) -> LiveContext:
        """A new context (the first append of ``context_id``), admitted, its events being sent."""
        config = self.config
        if self.state.draining:  # a graceful shutdown: the contexts open go on, no new one starts
            raise ProtocolError("shutting_down", "the server is shutting down: start the context on another server",
                                context_id, retry_after_s=5)
        if len(self.contexts) >= config.ws_max_contexts:
            raise ProtocolError("too_many_contexts", f"a socket may have {config.ws_max_contexts} contexts open: "
                                "end or cancel one first", context_id)
        if len(text) > config.max_input_chars:
            raise ProtocolError("text_too_long", f"{len(text)} characters appended, at most "
                                f"{config.max_input_chars} may wait to be spoken", context_id)
        try:
            ticket = self.state.admission.admit()
        except QueueFullError as e:
            raise ProtocolError("rate_limited", str(e), context_id, retry_after_s=config.retry_after_s) from None
        try:
            context = SpeechContext(self.state.client, context_id, code_params(self.settings, self.voice, config),
                                    config.in_flight_sentences, config.max_input_chars)
        except ValueError as e:
            ticket.cancel()
            raise ProtocolError("invalid_settings", str(e), context_id) from None
        live = self.contexts[context_id] = LiveContext(context, ticket)
        live.task = asyncio.create_task(self._produce(context_id, live))
        self.state.metrics.ws_contexts.inc()
        return live

    def _live(self, context_id: str) -> LiveContext:
        live = self.contexts.get(context_id)
        if live is None:
            raise ProtocolError("unknown_context", f"no open context {context_id!r}: a context opens with its "
                                "first input_text.append", context_id)
        return live

    async def _flush(self, m: Flush) -> None:
        live = self._live(m.context_id)
        if live.ended:
            raise ProtocolError("context_ended", f"context {m.context_id!r} has ended", m.context_id)
        live.context.flush()

    async def _end(self, m: End) -> None:
        live = self._live(m.context_id)
        if live.ended:
            raise ProtocolError("context_ended", f"context {m.context_id!r} has ended", m.context_id)
        live.ended = True
        live.context.end()

    async def _cancel(self, m: Cancel) -> None:
        live = self._live(m.context_id)
        del self.contexts[m.context_id]
        await self._stop(live)
        await self.send({"type": "context.cancelled", "context_id": m.context_id})

    async def _close(self, m: SessionClose) -> None:
        self.reason = "closed"

    async def _auth(self, m: Auth) -> None:
        """Already authenticated (or no key is needed): nothing to do."""

    async def _produce(self, context_id: str, live: LiveContext) -> None:
        """Send ``live``'s events, inside a running slot, until its audio is done."""
        try:
            async with live.ticket.slot():
                live.waiting = False
                self._traffic()
                async for event in live.context.events():
                    await self._emit(context_id, live, event)
        except SocketGone:
            pass
        except Exception as e:  # noqa: BLE001 - the context fails alone, reported to its client
            logger.exception("realtime context failed")
            with contextlib.suppress(SocketGone):
                await self.send(ProtocolError("generation_failed", f"generation failed: {e}", context_id).event())
        finally:
            if self.contexts.get(context_id) is live:
                del self.contexts[context_id]

    async def _emit(self, context_id: str, live: LiveContext, event) -> None:
        if isinstance(event, AudioOut):
            if event.samples.size:
                audio = base64.b64encode(encode_all("pcm", event.samples)).decode()
                await self.send({"type": "audio.delta", "context_id": context_id, "audio": audio, "seq": live.seq})
                live.seq += 1
        elif isinstance(event, SegmentOut):
            await self.send({"type": "speech.segment", "context_id": context_id, "text": event.text,
                             "start_s": event.start_s, "end_s": event.end_s})
        elif isinstance(event, DoneOut):
            usage = {"input_characters": event.input_characters, "audio_seconds": event.audio_seconds}
            await self.send({"type": "audio.done", "context_id": context_id, "usage": usage})
        elif isinstance(event, FailedOut):
            await self.send(ProtocolError(event.code, event.message, context_id).event())

    async def _stop(self, live: LiveContext) -> None:
        """Cancel ``live``: its engine requests end, nothing more of it is sent, its admission is given back."""
        self.state.metrics.ws_cancels.inc()
        live.context.cancel()
        live.task.cancel()
        await asyncio.wait([live.task])
        live.ticket.cancel()  # a task cancelled before it ran never entered its slot
        live.ticket.release()

    async def _shutdown(self) -> None:
        """Cancel every context left and close the socket as ``reason`` says."""
        contexts, self.contexts = list(self.contexts.values()), {}
        for live in contexts:
            await self._stop(live)
        code = CLOSE_CODES.get(self.reason or "disconnected")
        if code is None:
            return
        # a client that stopped reading takes no close frame either: it gets a moment, not more
        wait = 1.0 if self.reason == "send_timeout" else self.config.ws_send_timeout_s
        with contextlib.suppress(TimeoutError, WebSocketDisconnect, RuntimeError):
            await within(self.ws.close(code), wait)
