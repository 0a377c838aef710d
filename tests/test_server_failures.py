"""Generation that fails after the response has started: a streamed audio body must break (the client sees an
incomplete response, never a short file that looks whole), and SSE ends with an error event. One in-process
server on 127.0.0.1 over the session's tiny checkpoint, with the audio iterator made to fail after one chunk."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_helpers import free_port

from chattts_velocity import pipeline
from chattts_velocity.audio.pump import PENDING
from chattts_velocity.server import ServerConfig
from chattts_velocity.server.app import build_app
from chattts_velocity.serving.local import LocalClient

BODY = {"model": "tts-1", "voice": "alloy", "input": "Hello there, this fails half way.", "seed": 3}


@pytest.fixture(scope="module")
def url(chat):
    import uvicorn

    app = build_app(LocalClient(chat), ServerConfig(max_new_token=64, api_key="k"))  # with the auth middleware
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def failing(monkeypatch):
    """The joined audio yields one chunk (PENDING while there is none yet, as the server reads it), then raises."""
    real = pipeline.JoinedAudio.__next__
    chunks = {}

    def next_then_fail(self):
        if chunks.get(id(self)):
            raise RuntimeError("injected failure")
        item = real(self)
        if item is not PENDING:
            chunks[id(self)] = 1
        return item

    monkeypatch.setattr(pipeline.JoinedAudio, "__next__", next_then_fail)


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3"])
def test_failure_mid_stream_breaks_the_audio_body(url, failing, fmt):
    with httpx.Client(timeout=60, headers={"Authorization": "Bearer k"}) as client:
        with client.stream("POST", url + "/v1/audio/speech", json={**BODY, "response_format": fmt}) as r:
            assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                for _ in r.iter_bytes():
                    pass


def test_failure_mid_stream_ends_sse_with_an_error_event(url, failing):
    with httpx.Client(timeout=60, headers={"Authorization": "Bearer k"}) as client:
        r = client.post(url + "/v1/audio/speech", json={**BODY, "response_format": "pcm", "stream_format": "sse"})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and "injected failure" in events[-1]["error"]["message"]


def test_the_server_still_serves_after_the_failures(url, chat):
    with httpx.Client(timeout=60, headers={"Authorization": "Bearer k"}) as client:
        r = client.post(url + "/v1/audio/speech", json={**BODY, "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 2 * 24000 * 0.1
    stats = chat.engine.stats().engine
    assert stats.num_running == 0 and stats.num_waiting == 0
