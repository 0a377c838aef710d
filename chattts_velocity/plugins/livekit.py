"""LiveKit Agents TTS over the realtime socket (``pip install -e ".[livekit]"`` from a clone, or
``"chattts-velocity[livekit]"``).

``TTS`` streams (``stream()``: text pushed as the LLM writes it, audio as each sentence is ready) and speaks
whole texts (``synthesize()``). One socket per ``TTS`` carries every stream, each stream one context of it: a
stream closed before its audio is done (a barge-in) cancels its context on the server. Each spoken sentence's
place in the audio comes back as an aligned transcript (``TimedString``).

    from chattts_velocity.plugins import livekit as chattts

    session = AgentSession(tts=chattts.TTS(base_url="ws://127.0.0.1:8000", voice="alloy", seed=7), ...)
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import replace

from livekit.agents import APIConnectionError, APIError, APIStatusError, APITimeoutError, tts, utils
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, APIConnectOptions, TimedString

from ..constants import SAMPLE_RATE
from .connection import (
    API_KEY_ENV,
    RealtimeConnection,
    RealtimeError,
    RemoteContext,
    SpeechSettings,
    audio_of,
    stream_url,
)

STATUS = {"rate_limited": 429, "invalid_api_key": 401}
"""Error codes that have an HTTP status of their own (it decides LiveKit's retry)."""


class TTS(tts.TTS):
    """ChatTTS through a chattts-velocity server's realtime socket: 24 kHz mono PCM, streamed."""

    def __init__(self, *, base_url: str = "ws://127.0.0.1:8000", api_key: str | None = None,
                 voice: str | dict = "alloy", seed: int | None = None, speed: float | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 prompt: str | None = None, refine_text: bool | None = None) -> None:
        """``base_url``: the server (http(s):// or ws(s)://); ``api_key``: its key (default
        ``$CHATTTS_VELOCITY_API_KEY``); the rest: the session settings, as ``POST /v1/audio/speech`` takes them
        (None keeps the server's default)."""
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
                         sample_rate=SAMPLE_RATE, num_channels=1)
        self._url = stream_url(base_url)
        self._api_key = api_key or os.environ.get(API_KEY_ENV)
        self._settings = SpeechSettings(voice=voice, seed=seed, speed=speed, temperature=temperature,
                                        top_p=top_p, top_k=top_k, prompt=prompt, refine_text=refine_text)
        self._connection: RealtimeConnection | None = None
        self._connecting = asyncio.Lock()
        self._streams = weakref.WeakSet[SynthesizeStream]()
        self._prewarm: asyncio.Task[None] | None = None

    @property
    def model(self) -> str:
        return "chattts"

    @property
    def provider(self) -> str:
        return "chattts-velocity"

    def update_options(self, **settings: object) -> None:
        """Change session settings (``voice``, ``seed``, ``speed``, ...) for the streams started after this."""
        self._settings = replace(self._settings, **settings)

    def synthesize(self, text: str, *,
                   conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> ChunkedStream:
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def prewarm(self) -> None:
        self._prewarm = asyncio.create_task(self._prewarm_connection())

    async def _prewarm_connection(self) -> None:
        with suppress(RealtimeError, asyncio.TimeoutError):  # the first stream reports the failure
            await self._connect(DEFAULT_API_CONNECT_OPTIONS.timeout)

    async def aclose(self) -> None:
        for stream in list(self._streams):
            await stream.aclose()
        self._streams.clear()
        if self._connection is not None:
            await self._connection.aclose()
            self._connection = None

    async def _connect(self, timeout: float) -> RealtimeConnection:
        """The open socket with the current settings, opened again if it was lost."""
        async with self._connecting:
            if self._connection is None or self._connection.closed:
                self._connection = await RealtimeConnection.open(self._url, self._api_key, self._settings, timeout)
            await self._connection.configure(self._settings, timeout)
            return self._connection

    @asynccontextmanager
    async def _context(self, timeout: float) -> AsyncIterator[RemoteContext]:
        """A new context on the socket, with LiveKit's errors for the server's."""
        try:
            connection = await self._connect(timeout)
            with connection.context(utils.shortuuid()) as ctx:
                yield ctx
        except RealtimeError as e:
            raise api_error(e) from None
        except asyncio.TimeoutError:
            raise APITimeoutError() from None


class ChunkedStream(tts.ChunkedStream):
    """One text, spoken as one context (append, end)."""

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        tts_: TTS = self._tts  # type: ignore[assignment]
        async with tts_._context(self._conn_options.timeout) as ctx:
            output_emitter.initialize(request_id=ctx.id, sample_rate=SAMPLE_RATE, num_channels=1,
                                      mime_type="audio/pcm")
            ctx.append(self._input_text)
            ctx.end()
            await emit(ctx, output_emitter)
        output_emitter.flush()


class SynthesizeStream(tts.SynthesizeStream):
    """Text pushed in pieces, spoken as one context: ``push_text`` appends, ``flush`` speaks what is buffered,
    ``end_input`` ends the context; closing the stream early cancels it."""

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        tts_: TTS = self._tts  # type: ignore[assignment]
        async with tts_._context(self._conn_options.timeout) as ctx:
            output_emitter.initialize(request_id=ctx.id, sample_rate=SAMPLE_RATE, num_channels=1,
                                      mime_type="audio/pcm", stream=True)
            sender = asyncio.create_task(self._send_input(ctx, output_emitter))
            try:
                await emit(ctx, output_emitter)
                await sender
            finally:
                await utils.aio.gracefully_cancel(sender)

    async def _send_input(self, ctx: RemoteContext, output_emitter: tts.AudioEmitter) -> None:
        segment_started = False  # the emitter's one segment starts with the context's first words
        async for data in self._input_ch:
            if isinstance(data, self._FlushSentinel):
                ctx.flush()
                continue
            ctx.append(data)
            if ctx.started and not segment_started:
                segment_started = True
                output_emitter.start_segment(segment_id=ctx.id)
                self._mark_started()
        ctx.end()


async def emit(ctx: RemoteContext, output_emitter: tts.AudioEmitter) -> None:
    """A context's audio into ``output_emitter`` and each sentence's place as a timed transcript."""
    async for event in ctx.events():
        kind = event["type"]
        if kind == "audio.delta":
            output_emitter.push(audio_of(event))
        elif kind == "speech.segment":
            output_emitter.push_timed_transcript(
                TimedString(event["text"], start_time=event["start_s"], end_time=event["end_s"]))


def api_error(e: RealtimeError) -> APIError:
    """LiveKit's error for the server's (its retry follows ``retryable`` and the HTTP status)."""
    if e.code in ("connection_failed", "connection_closed"):
        return APIConnectionError(e.message)
    if e.code in STATUS:
        return APIStatusError(e.message, status_code=STATUS[e.code], body={"code": e.code})
    return APIError(e.message, body={"code": e.code}, retryable=e.retryable)
