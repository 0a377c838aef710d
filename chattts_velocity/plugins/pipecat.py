"""pipecat TTS service over the realtime socket (``pip install -e ".[pipecat]"`` from a clone, or
``"chattts-velocity[pipecat]"``).

One socket for the service's life; each turn (an LLM reply, or a ``TTSSpeakFrame``) is one context of it:
``run_tts`` appends the turn's text (and flushes it, sentence by sentence, unless text is streamed token by
token), the end of the turn ends the context, and its audio comes back as ``TTSAudioRawFrame``s (24 kHz mono)
between ``TTSStartedFrame`` and ``TTSStoppedFrame``. An interruption cancels the contexts still speaking on the
same socket, with no reconnect; late audio of a cancelled context is dropped.

    from chattts_velocity.plugins.pipecat import ChatTTSVelocityTTSService

    tts = ChatTTSVelocityTTSService(base_url="ws://127.0.0.1:8000",
                                    settings=ChatTTSVelocityTTSService.Settings(voice="alloy", seed=7))
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import WebsocketTTSService
from pipecat.utils.types import NOT_GIVEN, NotGiven
from websockets.protocol import State

from ..constants import SAMPLE_RATE
from .connection import (
    API_KEY_ENV,
    MAX_FRAME,
    SpeechSettings,
    audio_of,
    auth_headers,
    message,
    session_update,
    stream_url,
)

ENDS_CONTEXT = frozenset({"rate_limited", "too_many_contexts", "generation_failed"})
"""Error codes after which a context makes no audio: its audio context is closed at once."""
QUIET_ERRORS = frozenset({"idle_timeout"})
"""Socket errors that are no fault: the server closes an idle socket, and the receive loop opens another."""


def _not_given() -> Any:
    return field(default_factory=lambda: NOT_GIVEN)


@dataclass
class ChatTTSVelocityTTSSettings(TTSSettings):
    """The session settings beside ``voice``, as ``POST /v1/audio/speech`` takes them (None: the server's
    default)."""

    seed: int | None | NotGiven = _not_given()
    speed: float | None | NotGiven = _not_given()
    temperature: float | None | NotGiven = _not_given()
    top_p: float | None | NotGiven = _not_given()
    top_k: int | None | NotGiven = _not_given()
    prompt: str | None | NotGiven = _not_given()
    refine_text: bool | None | NotGiven = _not_given()


class ChatTTSVelocityTTSService(WebsocketTTSService):
    """ChatTTS through a chattts-velocity server's realtime socket."""

    Settings = ChatTTSVelocityTTSSettings
    _settings: ChatTTSVelocityTTSSettings

    def __init__(self, *, base_url: str = "ws://127.0.0.1:8000", api_key: str | None = None,
                 settings: ChatTTSVelocityTTSSettings | None = None, **kwargs: Any):
        """``base_url``: the server (http(s):// or ws(s)://); ``api_key``: its key (default
        ``$CHATTTS_VELOCITY_API_KEY``); ``settings``: voice, seed, speed, ... (runtime-updatable)."""
        store = self.Settings(model=None, voice="alloy", language=None, seed=None, speed=None, temperature=None,
                              top_p=None, top_k=None, prompt=None, refine_text=None)
        if settings is not None:
            store.apply_update(settings)
        super().__init__(push_start_frame=True, sample_rate=SAMPLE_RATE, settings=store, **kwargs)
        self._url = stream_url(base_url)
        self._api_key = api_key or os.environ.get(API_KEY_ENV)
        self._receive_task = None

    def can_generate_metrics(self) -> bool:
        return True

    def speech_settings(self) -> SpeechSettings:
        """The session settings the socket is given."""
        s = self._settings
        return SpeechSettings(voice=s.voice or "alloy", seed=s.seed, speed=s.speed, temperature=s.temperature,
                              top_p=s.top_p, top_k=s.top_k, prompt=s.prompt, refine_text=s.refine_text)

    async def setup(self, setup: FrameProcessorSetup) -> None:
        await super().setup(setup)
        await self._connect()

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Append ``text`` to the turn's context (flushed unless tokens are streamed); the audio comes back on
        the receive task."""
        try:
            if self._websocket is None or self._websocket.state is State.CLOSED:
                await self._connect()
            await self._send(message("input_text.append", context_id, text=text))
            if not self._is_streaming_tokens:
                await self._send(message("input_text.flush", context_id))
            await self.start_tts_usage_metrics(text)
        except Exception as e:
            yield ErrorFrame(error=f"{self} could not send text: {e}")
            yield TTSStoppedFrame(context_id=context_id)
            return
        yield None

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The turn is over: its context ends after its audio."""
        context_id = context_id or self.get_active_audio_context_id()
        if context_id and self._websocket is not None:
            await self._send(message("input_text.end", context_id))

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: cancel the context on the server (the socket stays)."""
        await self.stop_all_metrics()
        if self._websocket is not None and self._websocket.state is State.OPEN:
            await self._send(message("context.cancel", context_id))
        await super().on_audio_context_interrupted(context_id)

    async def _update_settings(self, delta: TTSSettings) -> dict[str, Any]:
        """New settings go to the socket at once; a context takes them at its first append."""
        changed = await super()._update_settings(delta)
        if changed and self._websocket is not None and self._websocket.state is State.OPEN:
            await self._send(session_update(self.speech_settings()))
        return changed

    async def _connect(self) -> None:
        await super()._connect()
        await self._connect_websocket()
        if self._websocket is not None and self._receive_task is None:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self) -> None:
        await super()._disconnect()
        if self._receive_task is not None:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _connect_websocket(self) -> None:
        if self._websocket is not None and self._websocket.state is State.OPEN:
            return
        try:
            self._websocket = await self._websocket_connect(self._url, additional_headers=auth_headers(self._api_key),
                                                            max_size=MAX_FRAME)
            await self._websocket.send(session_update(self.speech_settings()))
            await self._call_event_handler("on_connected")
        except Exception as e:
            self._websocket = None
            await self.push_error(error_msg=f"{self} could not connect to {self._url}: {e}", exception=e)
            await self._call_event_handler("on_connection_error", f"{e}")

    async def _disconnect_websocket(self) -> None:
        try:
            await self.stop_all_metrics()
            if self._websocket is not None:
                await self._websocket.close()
        except Exception as e:
            await self.push_error(error_msg=f"{self} error while closing: {e}", exception=e)
        finally:
            self._websocket = None
            await self._call_event_handler("on_disconnected")

    async def _receive_messages(self) -> None:
        async for frame in self._websocket:
            await self._handle_event(json.loads(frame))

    async def _handle_event(self, event: dict) -> None:
        kind, context_id = event.get("type"), event.get("context_id")
        if context_id is None:
            if kind == "error" and event.get("code") not in QUIET_ERRORS:
                await self.push_error(error_msg=f"{self}: {event.get('code')}: {event.get('message')}")
            return
        if not self.audio_context_available(context_id):
            logger.trace(f"{self} dropped {kind} of context {context_id} (cancelled or done)")
            return
        if kind == "audio.delta":
            frame = TTSAudioRawFrame(audio=audio_of(event), sample_rate=SAMPLE_RATE, num_channels=1,
                                     context_id=context_id)
            await self.append_to_audio_context(context_id, frame)
        elif kind == "audio.done":
            await self._end_context(context_id)
        elif kind == "error":
            await self.push_error(error_msg=f"{self}: {event.get('code')}: {event.get('message')}")
            if event.get("code") in ENDS_CONTEXT:
                await self._end_context(context_id)

    async def _end_context(self, context_id: str) -> None:
        await self.stop_ttfb_metrics()
        await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
        await self.remove_audio_context(context_id)

    async def _send(self, frame: str) -> None:
        if self._websocket is None:
            raise ConnectionError(f"{self} is not connected")
        await self._websocket.send(frame)
