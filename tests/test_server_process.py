"""``serve --engine-process``: what the process split adds to the server tests run in both modes
(`test_server.py`, `test_server_shutdown.py`): a client that leaves has its engine requests aborted across the
pipe, ``--min-new-token`` holds every request to one length, and a dead engine process fails the requests in
flight, turns ``/health`` and new requests into 503s, and the front still exits cleanly."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from server_helpers import API_KEY, ServerProcess, engine_processes, metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKENS = 300


def body(text: str = "One sentence, spoken at its full length.", seed: int = 1) -> dict:
    return {"model": "tts-1", "voice": "echo", "input": text, "response_format": "pcm", "seed": seed}


@pytest.fixture(scope="module")
def server(upstream_ckpt):
    srv = ServerProcess(upstream_ckpt, "--engine-process", "--max-new-token", str(TOKENS), "--min-new-token",
                        str(TOKENS))
    yield srv
    srv.stop()


def test_min_new_token_holds_every_request_to_its_length(server):
    for seed in (1, 2):
        r = httpx.post(server.url + "/v1/audio/speech", json=body(seed=seed), headers=AUTH, timeout=60)
        assert r.status_code == 200
        assert len(r.content) // 2 == (2 * TOKENS - 1) * 256  # T tokens decode to (2T - 1) * 256 samples


def test_a_client_that_leaves_has_its_requests_aborted_in_the_engine_process(server):
    text = " ".join(f"Sentence {i} of a long request that the client leaves early." for i in range(6))
    before = metric(server.url, "chattts_generated_tokens")
    for seed in range(3):
        with httpx.stream("POST", server.url + "/v1/audio/speech", json=body(text, seed), headers=AUTH,
                          timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_bytes())  # the first chunk: generation is under way
    deadline = time.monotonic() + 10
    while metric(server.url, "chattts_kv_blocks_used") > 0 or metric(server.url, "chattts_engine_running") > 0:
        assert time.monotonic() < deadline, "the engine process kept the requests the clients left"
        time.sleep(0.1)
    # every sentence generates exactly TOKENS (--min-new-token): finished, the three would have made them all
    assert metric(server.url, "chattts_generated_tokens") - before < 3 * 6 * TOKENS


def test_a_dead_engine_process_fails_requests_with_503_and_the_front_exits_cleanly(server):
    (engine,) = engine_processes(server.proc.pid)
    text = " ".join(f"Sentence {i} is cut off when the engine process dies." for i in range(6))
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body(text), headers=AUTH, timeout=60) as r:
        chunks = r.iter_bytes()
        got = len(next(chunks))
        os.kill(engine, signal.SIGKILL)
        with pytest.raises(httpx.RemoteProtocolError):  # cut off: never a short body that looks whole
            for chunk in chunks:
                got += len(chunk)
    assert 0 < got < 6 * (2 * TOKENS - 1) * 256 * 2  # s16le: the whole body would be every sentence's samples
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and "engine process" in health.json()["status"]
    late = httpx.post(server.url + "/v1/audio/speech", json=body(), headers=AUTH, timeout=10)
    assert late.status_code == 503 and "engine process" in late.json()["error"]["message"]
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 503
    refined = httpx.post(server.url + "/v1/audio/speech", json={**body(), "refine_text": True}, headers=AUTH, timeout=10)
    assert refined.status_code == 503 and "engine process" in refined.json()["error"]["message"]
    # the front prepares requests itself: it still knows the voices (and still refuses a bad request with its 4xx)
    voices = httpx.get(server.url + "/v1/audio/voices", headers=AUTH, timeout=10)
    assert voices.status_code == 200 and "alloy" in {v["id"] for v in voices.json()["voices"]}
    unknown = httpx.post(server.url + "/v1/audio/speech", json={**body(), "voice": "nobody"}, headers=AUTH, timeout=10)
    assert unknown.status_code == 404
    server.terminate()
    assert server.proc.wait(30) == 0


class _Owner:
    """Stands in for ``EngineProcess`` under a ``RemoteAudio``: records the cancels it would send."""

    def __init__(self):
        self.cancelled = []

    def _cancel(self, rid):
        self.cancelled.append(rid)


def test_remote_audio_reads_like_joined_audio():
    import threading

    import numpy as np

    from chattts_velocity.audio.pump import PENDING, take_ready
    from chattts_velocity.server.split import RemoteAudio

    owner = _Owner()
    blocking = RemoteAudio(owner, "a")  # no on_ready: next waits for the reader thread's chunk
    threading.Timer(0.05, blocking._put, (np.ones(3, np.float32), None)).start()
    assert next(blocking).tolist() == [1, 1, 1]
    blocking._put(None, "")
    with pytest.raises(StopIteration):
        next(blocking)
    blocking.cancel()  # over: nothing to cancel
    assert owner.cancelled == []

    woken = []
    audio = RemoteAudio(owner, "b")
    audio.on_ready(lambda: woken.append(1))
    assert next(audio) is PENDING
    audio._put(np.zeros(2, np.float32), None)
    audio._put(np.ones(2, np.float32), None)
    audio._put(None, "the engine process exited")
    assert len(woken) == 3
    chunk, end, failure = take_ready(audio)  # the chunks first, then the failure
    assert chunk.tolist() == [0, 0, 1, 1] and end and isinstance(failure, RuntimeError)
    assert str(failure) == "the engine process exited"

    left = RemoteAudio(owner, "c")
    left.cancel()
    left.cancel()
    assert owner.cancelled == ["c"]  # once, and nothing arrives after it
    left._put(np.ones(1, np.float32), None)
    with pytest.raises(StopIteration):
        next(left)


def test_engine_process_and_replicas_do_not_combine(tmp_path):
    import subprocess
    import sys

    for flag in (["--engine-process"], ["--fronts", "2"]):
        run = subprocess.run([sys.executable, "-m", "chattts_velocity.cli", "serve", "--model", str(tmp_path),
                              *flag, "--replicas", "2"], capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and "--engine-process" in run.stderr and "Traceback" not in run.stderr


def test_fronts_refuse_a_port_another_server_shares_out(tmp_path):
    """Another server's ``SO_REUSEPORT`` socket would let ``--fronts`` bind the same port and share its
    connections: the first front checks the port is free and says so if not."""
    import socket
    import subprocess
    import sys

    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "chattts_velocity.cli", "serve", "--model", str(tmp_path),
                              "--fronts", "2", "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in run.stderr
    assert "Traceback" not in run.stderr


def test_prompts_cross_the_pipe_as_plain_arrays(upstream_ckpt):
    """What the front sends to run: the prompts ``prepare_prompts`` made, as numpy arrays (a torch tensor would be
    pickled as shared memory whose descriptor the engine process fetches back from the front), and they come
    out equal to what the one-process server builds from the same request."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch

    from chattts_velocity import Chat
    from chattts_velocity.server.config import ServerConfig
    from chattts_velocity.server.prepare import SpeechKit, prepare_prompts, speech_plan
    from chattts_velocity.server.schema import SpeechRequest
    from chattts_velocity.server.split import _arrays, _prompts
    from chattts_velocity.server.voices import VoiceRegistry

    chat = Chat()
    chat.load(source="custom", custom_path=upstream_ckpt, device="cpu")
    try:
        import pickle

        kit = pickle.loads(pickle.dumps(SpeechKit.of(chat)))  # as the front gets it
        config = ServerConfig(max_new_token=TOKENS)
        request = SpeechRequest(model="tts-1", voice="alloy", input="One sentence here. And a second one!", seed=3)
        prompts, params = prepare_prompts(kit, VoiceRegistry(kit), config, request)
        texts, code = speech_plan(chat, VoiceRegistry(chat), config, request)
        expected = chat.pipeline.code_prompts(texts, code)
        assert len(prompts) == len(expected) == 2
        buf = io.BytesIO()
        ForkingPickler(buf).dump(("run", "r0", _arrays(prompts), params))
        assert b"torch" not in buf.getvalue()
        for got, want in zip(_prompts(pickle.loads(buf.getvalue())[2]), expected, strict=True):
            assert torch.equal(got.ids, want.ids) and torch.equal(got.text_mask, want.text_mask)
            assert torch.equal(got.speaker, want.speaker)
        with pytest.raises(ValueError, match="refine"):
            prepare_prompts(kit, VoiceRegistry(kit), config, request.model_copy(update={"refine_text": True}))
    finally:
        chat.unload()


def test_a_request_the_engine_process_refuses_ends_its_audio_with_the_error(upstream_ckpt):
    """The front prepared and validated a request, but the engine process refuses it all the same: its audio
    (whose headers are out) ends with the engine's error instead of hanging, and the engine process goes on
    serving. Both sides in this process, over real pipes, as ``benchmarks/serve_timeline.py --split`` hosts
    them."""
    import multiprocessing as mp
    import threading

    from chattts_velocity import Chat
    from chattts_velocity.audio.pump import PENDING, take_ready
    from chattts_velocity.server.config import ServerConfig
    from chattts_velocity.server.prepare import prepare_prompts
    from chattts_velocity.server.schema import SpeechRequest
    from chattts_velocity.server.split import EngineProcess, _Host
    from chattts_velocity.server.voices import VoiceRegistry

    chat = Chat()
    chat.load(source="custom", custom_path=upstream_ckpt, device="cpu")
    cmd_in, cmd = mp.Pipe(duplex=False)
    events, events_out = mp.Pipe(duplex=False)
    audio_in, audio_out = mp.Pipe(duplex=False)
    config = ServerConfig(max_new_token=40)
    host = _Host(chat, config, [(cmd_in, events_out, audio_out)])
    host.announce()
    threading.Thread(target=host.serve, daemon=True).start()
    front = EngineProcess(cmd, events, audio_in)
    try:
        front.wait_ready(60)
        request = SpeechRequest(model="tts-1", voice="alloy", input="Refused by the engine.", seed=1)

        def read(audio) -> tuple[int, Exception | None]:
            woken = threading.Event()
            audio.on_ready(woken.set)
            samples, deadline = 0, time.monotonic() + 60
            while time.monotonic() < deadline:
                woken.clear()
                chunk, end, failure = take_ready(audio)
                samples += 0 if chunk is None or chunk is PENDING else chunk.size
                if end:
                    return samples, failure
                woken.wait(5)
            pytest.fail("the audio did not end")

        def refuse(*args, **kwargs):
            raise ValueError("the engine says no")

        chat.pipeline.joined = refuse
        samples, failure = read(front.run(*prepare_prompts(front.kit, VoiceRegistry(front.kit), config, request)))
        assert samples == 0 and isinstance(failure, RuntimeError) and "the engine says no" in str(failure)
        del chat.pipeline.joined  # the engine process serves the next request
        samples, failure = read(front.run(*prepare_prompts(front.kit, VoiceRegistry(front.kit), config, request)))
        assert failure is None and samples > 0
    finally:
        front.close()
        chat.unload()
