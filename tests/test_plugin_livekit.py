"""The LiveKit Agents plugin (``chattts_velocity.plugins.livekit.TTS``) against a real server, through LiveKit's own
classes (``ChunkedStream``, ``SynthesizeStream``, ``AudioEmitter``): ``synthesize()`` and ``stream()`` (text
pushed in pieces) give ``POST /v1/audio/speech``'s samples, each sentence comes back as a timed transcript, and a
stream closed mid-way (a barge-in) cancels its context on the same socket, its KV blocks freed."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import realtime_helpers
from livekit.agents import APIConnectOptions, APIStatusError
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from server_helpers import API_KEY, ServerProcess, metric

from chattts_velocity.plugins import livekit as chattts

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKENS = 48
NO_RETRY = APIConnectOptions(max_retry=0)
TEXT = "The first sentence is short. The second one follows it closely. A third one ends the text."
LONG = " ".join(f"Sentence number {i} is one of many in a long answer." for i in range(8))


@pytest.fixture(scope="module")
def server(upstream_ckpt):
    srv = ServerProcess(upstream_ckpt, "--max-new-token", str(TOKENS), "--min-new-token", str(TOKENS))
    yield srv
    srv.stop()


def http_pcm(server, text: str, seed: int, voice: str = "alloy") -> np.ndarray:
    return realtime_helpers.http_pcm(server, text, seed, voice)


def pcm_of(events: list) -> np.ndarray:
    """The samples of LiveKit's ``SynthesizedAudio`` events, less the 10 ms silent marker its ``AudioEmitter``
    adds at the end of a segment whose held-back tail it already flushed (it counts no duration)."""
    frames = [ev.frame for ev in events]
    last = frames[-1] if frames else None
    if last is not None and events[-1].is_final and last.samples_per_channel == last.sample_rate // 100 \
            and not np.frombuffer(last.data, dtype="<i2").any():
        frames = frames[:-1]
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in frames)
    return np.concatenate([np.frombuffer(f.data, dtype="<i2") for f in frames])


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert len(got) == len(want)
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


def tts_for(server, seed: int, **kw) -> chattts.TTS:
    return chattts.TTS(base_url=server.url, api_key=API_KEY, voice="alloy", seed=seed, **kw)


def test_synthesize_gives_the_http_routes_samples(server):
    async def main():
        async with tts_for(server, seed=11) as tts:
            return [ev async for ev in tts.synthesize(TEXT)]

    events = asyncio.run(main())
    assert_same_audio(pcm_of(events), http_pcm(server, TEXT, seed=11))
    assert events[-1].is_final and not any(ev.is_final for ev in events[:-1])


@pytest.mark.parametrize("piece", [1, 7, 40], ids=["chars", "words", "sentences"])
def test_stream_with_text_pushed_in_pieces_gives_the_http_routes_samples(server, piece):
    async def main():
        async with tts_for(server, seed=12) as tts:
            stream = tts.stream()
            for i in range(0, len(TEXT), piece):
                stream.push_text(TEXT[i:i + piece])
                await asyncio.sleep(0)
            stream.end_input()
            events = [ev async for ev in stream]
            await stream.aclose()
            return events

    events = asyncio.run(main())
    assert_same_audio(pcm_of(events), http_pcm(server, TEXT, seed=12))
    assert {ev.segment_id for ev in events} == {events[0].request_id}  # one stream, one segment, one context


def test_stream_reports_each_sentence_as_a_timed_transcript(server):
    async def main():
        async with tts_for(server, seed=13) as tts:
            stream = tts.stream()
            stream.push_text(TEXT)
            stream.end_input()
            events = [ev async for ev in stream]
            await stream.aclose()
            return events

    events = asyncio.run(main())
    timed = [t for ev in events for t in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert len(timed) == 3  # one per sentence
    seconds = len(pcm_of(events)) / 24000
    assert timed[0].start_time == 0
    for before, after in zip(timed, timed[1:], strict=False):
        assert before.end_time == pytest.approx(after.start_time)
    assert timed[-1].end_time == pytest.approx(seconds, abs=1e-3)
    assert [str(t) for t in timed] == ["The first sentence is short. ", "The second one follows it closely. ",
                                      "A third one ends the text."]  # the pieces of the text, as appended


def test_a_stream_closed_mid_way_cancels_its_context_and_the_socket_goes_on(server):
    async def main():
        async with tts_for(server, seed=14) as tts:
            stream = tts.stream()
            stream.push_text(LONG)
            stream.end_input()
            first = await stream.__anext__()  # audio is flowing
            connection = tts._connection
            await stream.aclose()  # barge-in
            await wait_engine_empty(server)
            events = [ev async for ev in tts.synthesize(TEXT)]
            return first, events, connection is tts._connection

    cancels = metric(server.url, "chattts_ws_cancels_total")
    tokens = metric(server.url, "chattts_generated_tokens")
    first, events, same_socket = asyncio.run(main())
    assert first.frame.samples_per_channel > 0
    assert metric(server.url, "chattts_ws_cancels_total") == cancels + 1
    assert metric(server.url, "chattts_generated_tokens") - tokens < 8 * TOKENS + 3 * TOKENS  # LONG was cut off
    assert same_socket
    assert_same_audio(pcm_of(events), http_pcm(server, TEXT, seed=14))


def test_update_options_changes_the_voice_of_the_next_stream_on_the_same_socket(server):
    async def main():
        async with tts_for(server, seed=15) as tts:
            await collect(tts.synthesize(TEXT))
            connection = tts._connection
            tts.update_options(voice="echo")
            events = await collect(tts.synthesize(TEXT))
            return events, connection is tts._connection

    events, same_socket = asyncio.run(main())
    assert same_socket
    assert_same_audio(pcm_of(events), http_pcm(server, TEXT, seed=15, voice="echo"))


def test_blank_text_opens_no_context(server):
    async def main():
        async with tts_for(server, seed=16) as tts:
            stream = tts.stream()
            stream.push_text(" ")
            stream.push_text("\n")
            stream.end_input()
            streamed = await collect(stream)
            await stream.aclose()
            return await collect(tts.synthesize("  ")), streamed

    contexts = metric(server.url, "chattts_ws_contexts_total")
    assert asyncio.run(main()) == ([], [])
    assert metric(server.url, "chattts_ws_contexts_total") == contexts


def test_a_server_refusal_is_a_livekit_api_error(server):
    async def main():
        async with chattts.TTS(base_url=server.url, api_key="wrong-key") as tts:
            return [ev async for ev in tts.synthesize(TEXT, conn_options=NO_RETRY)]

    with pytest.raises(APIStatusError) as refused:
        asyncio.run(main())
    assert refused.value.status_code == 401 and not refused.value.retryable




async def collect(stream) -> list:
    return [ev async for ev in stream]


async def wait_engine_empty(server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while metric(server.url, "chattts_kv_blocks_used") > 0 or metric(server.url, "chattts_engine_running") > 0:
        assert time.monotonic() < deadline, "the cancelled context kept its KV blocks"
        await asyncio.sleep(0.05)
