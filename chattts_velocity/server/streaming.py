"""A speech response's body: one request's audio (``EngineClient.start``'s ``RequestAudio``) read on the event
loop without a thread, woken by the engine's thread through ``Wakeups``, encoded on the fly (``audio_format``)
as bytes or as server-sent events, inside the request's admission slot. Server-sent events come sentence by
sentence (a ``SpeechContext`` over the request's prepared sentences, the same audio), with a ``speech.segment``
event giving each sentence's place in the audio. Leaving early (a client that went away) cancels the audio,
which ends its engine requests."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import gc
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import numpy as np
from fastapi.responses import StreamingResponse

from ..constants import SAMPLE_RATE
from ..pipeline import take_ready
from ..serving.client import RequestAudio
from .admission import Ticket
from .audio_format import CONTENT_TYPES, StreamEncoder
from .metrics import Metrics
from .realtime.context import AudioOut, DoneOut, FailedOut, SegmentOut, SpeechContext
from .schema import SpeechRequest
from .timeouts import within

logger = logging.getLogger(__name__)

TRIM_EVERY_S = 5.0
"""Least time between two hand-backs of the C heap's free memory (``Streams``)."""


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


_LIBC = _libc()


def _trim() -> None:
    gc.collect()  # cycles (tracebacks, finished tasks) still hold memory until collected
    _LIBC.malloc_trim(0)


class Wakeups:
    """Sets asyncio events of one loop from other threads, many per hop: the engine thread hands each round's
    audio to hundreds of streams, and the loop wakes once for all of them (``call_soon_threadsafe`` writes to
    the loop's wake-up pipe on every call)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._due: list[asyncio.Event] = []

    def set(self, event: asyncio.Event) -> None:
        with self._lock:
            self._due.append(event)
            if len(self._due) > 1:  # a flush is already on its way
                return
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop closed (shutdown): nobody waits any more
            pass

    def _flush(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for event in due:
            event.set()


class Wakeup:
    """One request's wake-up on the event loop: ``set`` from any thread (``RequestAudio.on_ready``)."""

    def __init__(self, wakeups: Wakeups):
        self._wakeups, self.ready = wakeups, asyncio.Event()

    def set(self) -> None:
        self._wakeups.set(self.ready)


class Streams:
    """The speech bodies of one app: how many are in flight (what a graceful shutdown waits for), the event
    loop's wake-ups, and the C heap's free memory handed back to the system when the server falls idle (glibc
    keeps what worker threads freed in their arenas: ``tests/test_server_load.py`` watches the server's size
    over many requests)."""

    def __init__(self, metrics: Metrics, send_timeout_s: float = 30.0):
        """``send_timeout_s``: how long a client may take to read one chunk (``ServerConfig.send_timeout_s``)."""
        self.metrics, self.send_timeout_s = metrics, send_timeout_s
        self.in_flight = 0
        """Speech bodies started and not yet done."""
        self._wakeups: Wakeups | None = None
        self._trimmed = 0.0

    def wakeup(self) -> Wakeup:
        """A new request's wake-up (on the event loop)."""
        loop = asyncio.get_running_loop()
        if self._wakeups is None or self._wakeups.loop is not loop:
            self._wakeups = Wakeups(loop)
        return Wakeup(self._wakeups)

    def response(self, body: SpeechRequest, audio: RequestAudio | SpeechContext, ticket: Ticket,
                 wakeup: Wakeup | None) -> StreamingResponse:
        """The response streaming ``audio`` as ``body`` asks (``wakeup``: the one given before it started; for
        ``stream_format`` "sse" ``audio`` is a ``SpeechContext`` holding the request's sentences, not started).
        Every format is sent as it is encoded (OpenAI's endpoint streams its body too; wav with an open-ended
        header), so the SDK's plain ``create`` and its streaming response read the same bytes."""
        if body.stream_format == "sse":
            return Admitted(self._sse(body, audio, ticket), ticket, audio, "text/event-stream", self.send_timeout_s)
        content = self._encoded(body, audio, ticket, wakeup)
        return Admitted(content, ticket, audio, CONTENT_TYPES[body.response_format], self.send_timeout_s)

    async def _chunks(self, audio: RequestAudio, ticket: Ticket, wakeup: Wakeup | None) -> AsyncIterator[np.ndarray]:
        """``audio``'s chunks inside an admission slot, read on the event loop: the engine's thread calls back
        when there is news (``on_ready``; ``wakeup``: the one given before the audio started), and every chunk
        there by then goes out as one. Closing this (a disconnect) cancels the audio, which ends its engine
        requests."""
        start, samples, first = time.monotonic(), 0, True
        async with self._running(ticket, audio):
            if wakeup is None:
                wakeup = self.wakeup()
                audio.on_ready(wakeup.set)
            ready = wakeup.ready
            while True:
                ready.clear()  # before looking: news from here on sets it again
                chunk, end, failure = take_ready(audio)
                if chunk is not None:
                    if first:
                        self.metrics.first_audio(time.monotonic() - start)
                        first = False
                    samples += chunk.size
                    yield chunk
                if failure is not None:
                    raise failure
                if end:
                    break
                await ready.wait()
            self.metrics.finished(samples / SAMPLE_RATE, time.monotonic() - start)

    async def _events(self, speech: SpeechContext, ticket: Ticket) -> AsyncIterator:
        """``speech``'s events inside an admission slot (``_chunks`` for a ``SpeechContext``)."""
        start, first = time.monotonic(), True
        async with self._running(ticket, speech), aclosing(speech.events()) as events:
            async for event in events:
                if first and isinstance(event, AudioOut):
                    self.metrics.first_audio(time.monotonic() - start)
                    first = False
                elif isinstance(event, DoneOut):
                    self.metrics.finished(event.audio_seconds, time.monotonic() - start)
                yield event

    @asynccontextmanager
    async def _running(self, ticket: Ticket, audio: RequestAudio | SpeechContext) -> AsyncIterator[None]:
        """A body's reading: inside ``ticket``'s running slot, counted in ``in_flight``; ``audio`` is cancelled
        on the way out (thread-safe; also when the request left before its audio started)."""
        async with ticket.slot():
            self.in_flight += 1
            try:
                yield
            finally:
                self.in_flight -= 1
                audio.cancel()
                if not self.in_flight:
                    self._trim_heap()

    async def _encoded(self, body: SpeechRequest, audio: RequestAudio, ticket: Ticket, wakeup: Wakeup | None
                       ) -> AsyncIterator[bytes]:
        encoder = StreamEncoder(body.response_format, SAMPLE_RATE)
        try:
            async for chunk in self._chunks(audio, ticket, wakeup):
                data = encoder.encode(chunk)
                if data:
                    yield data
            yield encoder.finish()
        except Exception:
            # the status is sent: re-raising makes the server drop the connection before the body's end, so the
            # client sees a broken response (an incomplete chunked body), never a short file that looks whole
            logger.exception("speech generation failed mid-stream")
            raise

    async def _sse(self, body: SpeechRequest, speech: SpeechContext, ticket: Ticket) -> AsyncIterator[bytes]:
        encoder = StreamEncoder(body.response_format, SAMPLE_RATE)
        tokens = 0
        try:
            async with aclosing(self._events(speech, ticket)) as events:
                async for event in events:
                    if isinstance(event, AudioOut):
                        tokens += event.samples.size / 512
                        data = encoder.encode(event.samples)
                        if data:
                            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                    elif isinstance(event, SegmentOut):
                        yield _event({"type": "speech.segment", "text": event.text, "start_s": event.start_s,
                                      "end_s": event.end_s})
                    elif isinstance(event, FailedOut):
                        logger.error("speech generation failed mid-stream: %s", event.message)
                        yield _event({"type": "error", "error": {"message": event.message, "type": "server_error"}})
                        return
            tail = encoder.finish()
            if tail:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
            n_in, n_out = len(body.input), round(tokens)
            yield _event({"type": "speech.audio.done",
                          "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}})
        except Exception as e:  # noqa: BLE001 - reported to the client as an error event
            logger.exception("speech generation failed mid-stream")
            yield _event({"type": "error", "error": {"message": f"generation failed: {e}", "type": "server_error"}})

    def _trim_heap(self) -> None:
        now = time.monotonic()
        if _LIBC is not None and now - self._trimmed > TRIM_EVERY_S:
            self._trimmed = now
            threading.Thread(target=_trim, daemon=True).start()


class Admitted(StreamingResponse):
    """Gives the ticket's queue place (or the slot it took early) back and cancels the audio if the body never
    started (the client left first)."""

    def __init__(self, content, ticket: Ticket, audio: RequestAudio | SpeechContext, media_type: str,
                 send_timeout_s: float):
        super().__init__(content, media_type=media_type)
        self.ticket, self.audio, self.send_timeout_s = ticket, audio, send_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        async def bounded(message) -> None:
            """A client that takes no chunk for ``send_timeout_s`` stopped reading: cut it off (the body's
            ``finally`` aborts its engine requests and gives its slot back)."""
            try:
                await within(send(message), self.send_timeout_s)
            except TimeoutError:
                logger.warning("a client read nothing for %g s: its response is cut off", self.send_timeout_s)
                raise

        try:
            await super().__call__(scope, receive, bounded)
        finally:
            self.ticket.cancel()
            self.ticket.release()
            self.audio.cancel()  # idempotent: a body that ran cancelled it already


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
