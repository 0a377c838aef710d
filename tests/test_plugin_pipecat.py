"""The pipecat plugin (``ChatTTSVelocityTTSService``) against a real server, in a pipeline run by pipecat's own
``PipelineWorker`` with its test processors: a ``TTSSpeakFrame`` or an LLM reply streamed as tokens gives
``TTSStartedFrame``, ``TTSAudioRawFrame``s with ``POST /v1/audio/speech``'s samples, ``TTSStoppedFrame``; an
interruption mid-audio cancels the context on the same socket (no reconnect), no audio of it follows, its KV
blocks are freed, and the next utterance speaks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest
import realtime_helpers
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection
from pipecat.tests.utils import QueuedFrameProcessor
from pipecat.workers.runner import WorkerRunner
from server_helpers import API_KEY, ServerProcess, metric

from chattts_velocity.plugins.pipecat import ChatTTSVelocityTTSService

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKENS = 48
TEXT = "The first sentence is short. The second one follows it closely. A third one ends the text."
LONG = " ".join(f"Sentence number {i} is one of many in a long answer." for i in range(8))


@pytest.fixture(scope="module")
def server(upstream_ckpt):
    srv = ServerProcess(upstream_ckpt, "--max-new-token", str(TOKENS), "--min-new-token", str(TOKENS))
    yield srv
    srv.stop()


def http_pcm(server, text: str, seed: int, voice: str = "alloy") -> np.ndarray:
    return realtime_helpers.http_pcm(server, text, seed, voice)


def pcm_of(frames: list[Frame]) -> np.ndarray:
    audio = [f for f in frames if isinstance(f, TTSAudioRawFrame)]
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    return np.concatenate([np.frombuffer(f.audio, dtype="<i2") for f in audio])


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert len(got) == len(want)
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


def wait_engine_empty(server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while metric(server.url, "chattts_kv_blocks_used") > 0 or metric(server.url, "chattts_engine_running") > 0:
        assert time.monotonic() < deadline, "the cancelled context kept its KV blocks"
        time.sleep(0.05)


def service_for(server, seed: int) -> ChatTTSVelocityTTSService:
    settings = ChatTTSVelocityTTSService.Settings(voice="alloy", seed=seed)
    return ChatTTSVelocityTTSService(base_url=server.url, api_key=API_KEY, settings=settings)


class Run:
    """``[source, service, sink]`` on a ``PipelineWorker``; the frames that reach the sink, in order."""

    def __init__(self, service: ChatTTSVelocityTTSService):
        self.down: asyncio.Queue[Frame] = asyncio.Queue()
        source = QueuedFrameProcessor(queue=asyncio.Queue(), queue_direction=FrameDirection.UPSTREAM)
        sink = QueuedFrameProcessor(queue=self.down, queue_direction=FrameDirection.DOWNSTREAM)
        self.worker = PipelineWorker(Pipeline([source, service, sink]), cancel_on_idle_timeout=False)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Run:
        started = asyncio.Event()

        @self.worker.event_handler("on_pipeline_started")
        async def _started(worker, frame):
            started.set()

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(self.worker)
        self._task = asyncio.create_task(runner.run())
        await asyncio.wait_for(started.wait(), 30)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.worker.queue_frame(EndFrame())
        await asyncio.wait_for(self._task, 30)

    async def send(self, *frames: Frame) -> None:
        for frame in frames:
            await self.worker.queue_frame(frame)

    async def until(self, done: Callable[[Frame], bool], timeout: float = 60) -> list[Frame]:
        """The frames reaching the sink up to the first that is ``done``."""
        got = []
        while not got or not done(got[-1]):
            got.append(await asyncio.wait_for(self.down.get(), timeout))
        return got


def tts_frames(frames: list[Frame]) -> list[type]:
    return [type(f) for f in frames if isinstance(f, (TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame))]


def stopped(frame: Frame) -> bool:
    return isinstance(frame, TTSStoppedFrame)


def test_a_speak_frame_gives_started_audio_stopped_with_the_http_routes_samples(server):
    async def main():
        async with Run(service_for(server, seed=21)) as run:
            await run.send(TTSSpeakFrame(TEXT))
            return await run.until(stopped)

    frames = asyncio.run(main())
    kinds = tts_frames(frames)
    assert kinds[0] is TTSStartedFrame and kinds[-1] is TTSStoppedFrame and set(kinds[1:-1]) == {TTSAudioRawFrame}
    assert len({f.context_id for f in frames if isinstance(f, TTSAudioRawFrame)}) == 1
    assert_same_audio(pcm_of(frames), http_pcm(server, TEXT, seed=21))


def test_an_llm_reply_streamed_as_tokens_gives_the_http_routes_samples(server):
    tokens = [TEXT[i:i + 5] for i in range(0, len(TEXT), 5)]

    async def main():
        async with Run(service_for(server, seed=22)) as run:
            await run.send(LLMFullResponseStartFrame(), *(LLMTextFrame(t) for t in tokens), LLMFullResponseEndFrame())
            return await run.until(stopped)

    frames = asyncio.run(main())
    kinds = tts_frames(frames)
    assert kinds[0] is TTSStartedFrame and kinds[-1] is TTSStoppedFrame and set(kinds[1:-1]) == {TTSAudioRawFrame}
    assert_same_audio(pcm_of(frames), http_pcm(server, TEXT, seed=22))


def test_an_interruption_cancels_the_context_without_reconnecting_and_the_next_utterance_speaks(server):
    connects = []

    async def main():
        service = service_for(server, seed=23)

        @service.event_handler("on_connected")
        async def _connected(svc):
            connects.append(svc)

        async with Run(service) as run:
            socket = service._websocket
            await run.send(TTSSpeakFrame(LONG))
            head = await run.until(lambda f: isinstance(f, TTSAudioRawFrame))  # audio is flowing
            await run.send(InterruptionFrame())
            await run.until(lambda f: isinstance(f, InterruptionFrame))
            await asyncio.to_thread(wait_engine_empty, server)
            await run.send(TTSSpeakFrame(TEXT))
            tail = await run.until(stopped)
            return head[-1].context_id, tail, service._websocket is socket

    cancels = metric(server.url, "chattts_ws_cancels_total")
    tokens = metric(server.url, "chattts_generated_tokens")
    cancelled, tail, same_socket = asyncio.run(main())
    assert same_socket and len(connects) == 1  # no reconnect
    assert metric(server.url, "chattts_ws_cancels_total") == cancels + 1
    assert metric(server.url, "chattts_generated_tokens") - tokens < 8 * TOKENS + 3 * TOKENS  # LONG was cut off
    assert all(getattr(f, "context_id", None) != cancelled for f in tail)  # none of the cancelled audio
    kinds = tts_frames(tail)
    assert kinds[0] is TTSStartedFrame and kinds[-1] is TTSStoppedFrame and set(kinds[1:-1]) == {TTSAudioRawFrame}
    assert_same_audio(pcm_of(tail), http_pcm(server, TEXT, seed=23))


def test_a_settings_update_changes_the_voice_of_the_next_utterance(server):
    async def main():
        async with Run(service_for(server, seed=24)) as run:
            await run.send(TTSUpdateSettingsFrame(delta=ChatTTSVelocityTTSService.Settings(voice="echo")),
                           TTSSpeakFrame(TEXT))
            return await run.until(stopped)

    assert_same_audio(pcm_of(asyncio.run(main())), http_pcm(server, TEXT, seed=24, voice="echo"))
