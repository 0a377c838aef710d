"""The speech server as clients use it: the official ``openai`` SDK (every format, streamed pcm, SSE), the
voices list as Open WebUI reads it, a registered voice, auth, limits and a battery of bad requests, against
one live server on 127.0.0.1 over a tiny checkpoint: once in one process, once with the engine in a process of
its own (``--engine-process``)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from server_helpers import API_KEY, ServerProcess, decode_audio, metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "Hello there. This is a test of the speech server."
FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
TOLERANCE_S = {"mp3": 0.1, "opus": 0.001, "aac": 0.1, "flac": 0.001, "wav": 0.001, "pcm": 0.001}
"""Streamed mp3 and aac keep the codec's priming and last-frame padding (no header can say how much: up to
2304 and 2047 samples, `tests/test_audio_format.py`); Ogg Opus trims them."""


@pytest.fixture(scope="module", params=["one-process", "engine-process"])
def server(request, tmp_path_factory, upstream_ckpt):
    voices = tmp_path_factory.mktemp("voices")
    split = ("--engine-process",) if request.param == "engine-process" else ()
    srv = ServerProcess(upstream_ckpt, "--max-new-token", "48", "--voices-dir", str(voices), "--max-concurrent", "4",
                        "--max-queue", "2", "--max-input-chars", "400", *split)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference_seconds(client) -> float:
    """Duration of the test request's audio (pcm, seed 7): every format must decode to it."""
    data = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
                                      extra_body={"seed": 7}).content
    assert len(data) % 2 == 0 and len(data) > 2 * 24000 * 0.2
    return len(data) / 2 / 24000


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_through_the_sdk_decodes_to_the_expected_duration(client, reference_seconds, fmt):
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format=fmt,
                                          extra_body={"seed": 7})
    samples, rate = decode_audio(response.content, fmt)
    assert rate == (48000 if fmt == "opus" else 24000)  # Ogg Opus always decodes at 48 kHz (RFC 7845)
    assert abs(samples.size / rate - reference_seconds) <= TOLERANCE_S[fmt], (fmt, samples.size / rate)
    assert np.abs(samples).max() > 0.01, "silence"


def test_content_types(server):
    want = {"mp3": "audio/mpeg", "opus": "audio/opus", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
            "pcm": "audio/pcm"}
    for fmt, ctype in want.items():
        r = httpx.post(server.url + "/v1/audio/speech", headers={**AUTH, "Accept": "application/octet-stream"},
                       json={"model": "x", "voice": "echo", "input": "hi there", "response_format": fmt, "seed": 1},
                       timeout=60)
        assert r.status_code == 200 and r.headers["content-type"].startswith(ctype), (fmt, r.headers)


SENTENCES = " ".join(f"Sentence number {n} is here." for n in ("one", "two", "three", "four", "five", "six"))
"""More sentences than a request runs at once (4): the later ones start only once earlier ones have finished, so
their audio comes after the first audio went out, however fast the engine (two short sentences once came in one
round, and one chunk, once the CPU engine got faster)."""


def test_streamed_pcm_arrives_in_chunks(client):
    whole = client.audio.speech.create(model="tts-1", voice="alloy", input=SENTENCES, response_format="pcm",
                                       extra_body={"seed": 7}).content
    chunks = []
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=SENTENCES,
                                                            response_format="pcm", extra_body={"seed": 7}) as r:
        for chunk in r.iter_bytes(chunk_size=None):
            chunks.append(chunk)
    assert len(chunks) > 1
    assert len(b"".join(chunks)) == len(whole) > 2 * 24000 * 0.5  # the whole body's duration


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_streaming_requests_hold_no_thread_each(server):
    """The audio is read on the event loop, woken by the engine thread: a wave of concurrent streams adds no
    thread per request to the server while they stream (a thread per request did: +4 here, the whole time)."""
    import statistics
    import threading
    import time

    def stream(seed: int, out: list) -> None:
        body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", "seed": seed}
        with httpx.stream("POST", server.url + "/v1/audio/speech", headers=AUTH, json=body, timeout=60) as r:
            out.append(sum(len(c) for c in r.iter_bytes()))

    def wave(seed: int) -> tuple[list[int], list[int]]:
        sizes, samples = [], []
        clients = [threading.Thread(target=stream, args=(seed + i, sizes)) for i in range(4)]  # --max-concurrent
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        while any(c.is_alive() for c in clients) and time.monotonic() < deadline:
            samples.append(_threads(server.proc.pid))
            time.sleep(0.005)
        for c in clients:
            c.join(60)
        return sizes, samples

    wave(100)  # the worker-thread pool that prepares requests is filled once
    before = _threads(server.proc.pid)
    sizes, samples = wave(200)
    assert len(sizes) == 4 and all(n > 24000 for n in sizes)
    assert len(samples) >= 10
    assert statistics.median(samples) - before <= 1, (before, samples)


def sse_events(server) -> list[dict]:
    """The events of an SSE speech response for ``TEXT`` (pcm, seed 7)."""
    events = []
    with httpx.stream("POST", server.url + "/v1/audio/speech", headers=AUTH, timeout=60,
                      json={"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm",
                            "stream_format": "sse", "seed": 7}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def test_sse_events_in_order_ending_with_done(server, reference_seconds):
    events = sse_events(server)
    types = [e["type"] for e in events]
    # how many deltas depends on timing (every chunk ready when the reader comes goes out in one event: on a
    # slow box the whole 0.4 s can be one); the order and the audio do not
    assert types[-1] == "speech.audio.done" and set(types[:-1]) == {"speech.audio.delta", "speech.segment"}
    assert types.count("speech.audio.delta") >= 1
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert abs(len(audio) / 2 / 24000 - reference_seconds) < 1e-3
    assert events[-1]["usage"]["output_tokens"] > 0


def test_sse_speech_segments_place_each_sentence_in_the_audio(server, reference_seconds):
    events = sse_events(server)
    segments = [e for e in events if e["type"] == "speech.segment"]
    assert [s["text"] for s in segments] == ["Hello there. ", "This is a test of the speech server."]
    assert segments[0]["start_s"] == 0 and abs(segments[-1]["end_s"] - reference_seconds) < 1e-3
    assert all(a["end_s"] == b["start_s"] < b["end_s"] for a, b in zip(segments[:-1], segments[1:], strict=True))
    sent = 0.0
    for event in events:  # each segment after its sentence's audio, before any of the next
        if event["type"] == "speech.audio.delta":
            sent += len(base64.b64decode(event["audio"])) / 2 / 24000
        elif event["type"] == "speech.segment":
            assert abs(sent - event["end_s"]) < 1e-3, (sent, event)


def test_voices_list_as_open_webui_reads_it_and_a_registered_voice(server, client):
    voices = httpx.get(server.url + "/v1/audio/voices", headers=AUTH).json()["voices"]
    ids = {v["id"] for v in voices}
    assert {"alloy", "echo", "nova", "shimmer", "cedar"} <= ids and all({"id", "name"} <= v.keys() for v in voices)
    sample_text = "A voice to clone. It speaks a few sentences. So the sample is long enough. To be useful."
    pcm = client.audio.speech.create(model="tts-1", voice="nova", input=sample_text, response_format="pcm",
                                     extra_body={"seed": 3}).content
    assert len(pcm) / 2 / 24000 > 0.5
    wav = io.BytesIO()
    sf.write(wav, np.frombuffer(pcm, dtype="<i2"), 24000, format="WAV")
    r = httpx.post(server.url + "/v1/audio/voices", headers=AUTH,
                   files={"audio": ("sample.wav", wav.getvalue(), "audio/wav")},
                   data={"transcript": sample_text, "name": "mine"})
    assert r.status_code == 201, r.text
    vid = r.json()["id"]
    assert vid in {v["id"] for v in httpx.get(server.url + "/v1/audio/voices", headers=AUTH).json()["voices"]}
    for voice in (vid, {"id": vid}):
        data = client.audio.speech.create(model="tts-1", voice=voice, input="spoken in my voice",
                                          response_format="pcm", extra_body={"seed": 3}).content  # no early EOS
        assert len(data) > 2 * 2400


def test_models_health_and_metrics(server):
    models = [m["id"] for m in httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]]
    assert {"tts-1", "tts-1-hd", "gpt-4o-mini-tts", "chattts-velocity"} <= set(models)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/").status_code == 200
    assert metric(server.url, "chattts_kv_blocks_total") > 0
    text = httpx.get(server.url + "/metrics").text
    for name in ("chattts_requests_total", "chattts_time_to_first_audio_seconds_bucket", "chattts_real_time_factor",
                 "chattts_queue_depth", "chattts_preemptions", "chattts_gc_pause_seconds_bucket"):
        assert name in text, name
    # every speech request that got audio was prepared first, and the preparation was timed (in both modes)
    r = httpx.post(server.url + "/v1/audio/speech", headers=AUTH, timeout=60,
                   json={"model": "tts-1", "voice": "alloy", "input": "hi there", "response_format": "pcm"})
    assert r.status_code == 200 and r.content
    prepared = metric(server.url, "chattts_prepare_seconds_count")
    assert prepared >= metric(server.url, "chattts_time_to_first_audio_seconds_count") > 0
    assert metric(server.url, "chattts_prepare_seconds_sum") > 0
    # the engine thread times its own turns (the engine process's too: they cross the pipe with its stats)
    assert metric(server.url, "chattts_engine_loop_seconds_count") > 0
    assert metric(server.url, "chattts_engine_loop_seconds_sum") > 0
    # and splits a request's first audio into its wait for a first token and from there to audio (the audio
    # pump's part of it too)
    for name in ("chattts_engine_first_token_seconds", "chattts_engine_first_audio_seconds",
                 "chattts_engine_first_decode_seconds"):
        assert metric(server.url, name + "_count") > 0 and metric(server.url, name + "_sum") > 0, name
    # and counts where its thread's time goes (not summed over fronts: one engine's)
    parts = {part: metric(server.url, f'chattts_engine_thread_seconds_total{{part="{part}"}}')
             for part in ("idle", "step", "step_device_wait", "deliver", "deliver_device_wait")}
    assert parts["step"] > 0 and parts["deliver"] > 0 and parts["idle"] > 0, parts
    # and its steps: prompt steps, decode windows, their steps and tokens
    counts = {name: metric(server.url, name + "_total") for name in (
        "chattts_engine_prompt_steps", "chattts_engine_windows", "chattts_engine_window_steps",
        "chattts_engine_window_tokens")}
    assert all(v > 0 for v in counts.values()), counts
    assert counts["chattts_engine_window_tokens"] >= counts["chattts_engine_window_steps"] >= counts[
        "chattts_engine_windows"], counts


def test_metrics_time_the_garbage_collections(server, client):
    """Full collections (the server runs one when it goes idle, to give memory back) are timed."""
    import re
    import time

    def full_collections() -> float:
        text = httpx.get(server.url + "/metrics").text
        found = re.search(r'^chattts_gc_pause_seconds_count\{generation="2"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    before, deadline, sent = full_collections(), time.monotonic() + 30, 0.0
    while full_collections() <= before and time.monotonic() < deadline:
        if time.monotonic() - sent > 6:  # the server trims at most every 5 s: idle again after a request
            client.audio.speech.create(model="tts-1", voice="alloy", input="hello there", response_format="pcm")
            sent = time.monotonic()
        time.sleep(0.2)
    assert full_collections() > before


BAD = [
    ({"input": ""}, 400, "input"),
    ({"input": "x" * 401}, 400, "input"),
    ({"voice": "no-such-voice"}, 404, "voice"),
    ({"voice": {"id": "voice_0000000000000000"}}, 404, "voice"),
    ({"response_format": "ogg"}, 400, "response_format"),
    ({"speed": 5.0}, 400, "speed"),
    ({"speed": 0.1}, 400, "speed"),
    ({"temperature": 0}, 400, "temperature"),
    ({"top_k": 0}, 400, "top_k"),
    ({"seed": -1}, 400, "seed"),
    ({"unknown_field": 1}, 400, "unknown_field"),
]


@pytest.mark.parametrize("change, status, param", BAD)
def test_bad_requests_get_openai_errors(server, change, status, param):
    body = {"model": "tts-1", "voice": "alloy", "input": "fine", **change}
    r = httpx.post(server.url + "/v1/audio/speech", headers=AUTH, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and "Traceback" not in r.text


def test_malformed_json_and_auth(server):
    r = httpx.post(server.url + "/v1/audio/speech", headers={**AUTH, "Content-Type": "application/json"},
                   content=b"{not json", timeout=10)
    assert r.status_code == 400 and "error" in r.json()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/audio/speech", headers=headers, timeout=10,
                       json={"model": "tts-1", "voice": "alloy", "input": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).audio.speech.create(
            model="tts-1", voice="alloy", input="hi")
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_over_the_queue_limit_is_429_with_retry_after(server):
    """4 running + 2 queued fit; more concurrent requests are refused at once, and the server recovers."""
    import concurrent.futures

    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm"}

    def post(_):
        return httpx.post(server.url + "/v1/audio/speech", headers=AUTH, json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(post, range(16)))
    codes = [r.status_code for r in responses]
    assert codes.count(200) >= 6 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["retry-after"] and limited.json()["error"]["type"] == "rate_limit_error"
    assert post(0).status_code == 200


def test_bench_serve_drives_the_server(server, tmp_path):
    from chattts_velocity.bench.serve import TEXT as BENCH_TEXT
    from chattts_velocity.bench.serve import ServeBenchConfig, run_and_report

    out = tmp_path / "bench_serve.json"
    report = run_and_report(ServeBenchConfig(url=server.url, streams=(1, 2), requests_per_stream=1, api_key=API_KEY,
                                             json_path=str(out)))
    rows = report["rows"]
    assert [r["streams"] for r in rows] == [1, 2] and all(r["failures"] == 0 for r in rows)
    assert all(r["ttfa_p50_ms"] > 0 and r["rtf_min"] > 0 for r in rows)
    assert all(0 < r["client_cpu_s"] and 0 < r["wall_s"] for r in rows)  # whether the client was the bottleneck
    # a request's timeline: headers, then first audio, then its end
    assert all(0 < r["headers_p50_ms"] <= r["ttfa_p50_ms"] <= r["request_p50_ms"] for r in rows)
    assert [r["client_processes"] for r in rows] == [1, 1]
    assert json.loads(out.read_text())["rows"] == rows
    # the engine thread's time over each level, from the server's counters: shares of the whole, steps among them
    for r in rows:
        assert sum(r["engine_thread"].values()) == pytest.approx(1.0) and r["engine_thread"]["step"] > 0, r
        # and the server's own means on the way to first audio: the first token's and the front's are timed before
        # the client has its audio; the engine times a first audio after the round that made it, which for a
        # short request can come after the level's last byte (then that mean is None), the pump's part inside it
        means = r["server_mean_ms"]
        assert set(means) == {"to_first_token", "to_first_audio", "first_decode", "first_audio"}, means
        assert 0 < means["to_first_token"] < 1e4 and 0 < means["first_audio"] < 1e4, means
        if means["to_first_audio"] is not None and means["first_decode"] is not None:
            assert 0 < means["first_decode"] <= means["to_first_audio"], means
    # a level split over client processes (one per stream here): every request counted once
    split = run_and_report(ServeBenchConfig(url=server.url, streams=(3,), requests_per_stream=2, api_key=API_KEY,
                                            json_path=None, streams_per_process=1))["rows"][0]
    assert split["client_processes"] == 3 and split["requests"] == 6 and split["failures"] == 0
    assert split["rtf_min"] > 0 and split["ttfa_p50_ms"] > 0
    # each client's first request and its later one, apart (the first level had one request per client)
    assert split["ttfa_p99_first_ms"] > 0 and split["ttfa_p99_later_ms"] > 0 and rows[0]["ttfa_p99_later_ms"] is None
    # the bench's own HTTP client reads the chunked body whole: the same audio as the openai SDK's client (httpx)
    traced = run_and_report(ServeBenchConfig(url=server.url, streams=(1,), requests_per_stream=2, api_key=API_KEY,
                                             json_path=None, trace=True))["rows"][0]["traced"]
    for seed, request in enumerate(sorted(traced, key=lambda r: r["nth"])):
        sdk = httpx.post(server.url + "/v1/audio/speech", headers=AUTH, timeout=120,
                         json={"model": "tts-1", "voice": "alloy", "input": BENCH_TEXT, "response_format": "pcm",
                               "seed": seed})
        assert sdk.status_code == 200 and request["audio_s"] == len(sdk.content) / 2 / 24000 > 0


def test_bench_serve_says_how_a_request_failed(tmp_path):
    """Nothing listens: the warm-up's request fails, and the bench stops saying how and when (before any byte)
    instead of timing levels of failures; no results file is written."""
    import socket

    from chattts_velocity.bench.serve import ServeBenchConfig, run_and_report

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "bench_serve.json"
    with pytest.raises(ValueError, match=r"no speech request to .* succeeded \(1 tried\): ConnectionRefusedError "
                                         r"before any byte: "):
        run_and_report(ServeBenchConfig(url=f"http://127.0.0.1:{port}", streams=(2,), requests_per_stream=1,
                                        timeout_s=5.0, json_path=str(out)))
    assert not out.exists()


def test_an_idle_connection_outlives_the_clients_keep_alive(server):
    """A connection idle for 6 s, past the 5 s for which httpx (under the openai SDK) reuses one, still answers
    on the same socket: with uvicorn's default 5 s the server closed it, and a client reusing it at that moment
    got a read error before any byte."""
    import socket
    import time

    host, port = server.url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

    def ask(sock) -> bytes:
        """One response, read whole (headers, then the body's content-length bytes); b"" if closed first."""
        sock.sendall(request)
        reply = b""
        while True:
            head, sep, body = reply.partition(b"\r\n\r\n")
            if sep:
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                if len(body) >= length:
                    assert len(body) == length, "more bytes than one response"
                    return reply
            chunk = sock.recv(4096)
            if not chunk:
                return reply  # closed by the server
            reply += chunk

    with socket.create_connection((host, int(port)), timeout=10) as sock:
        assert ask(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        assert ask(sock).startswith(b"HTTP/1.1 200"), "the server closed the idle connection"


def test_keep_alive_and_audio_round_are_checked():
    from chattts_velocity.server import ServerConfig

    with pytest.raises(ValueError, match="keep_alive_s must be an int >= 1"):
        ServerConfig(keep_alive_s=0)
    for bad in (-1, 1001, float("nan")):
        with pytest.raises(ValueError, match="audio_round_ms must be within 0-1000"):
            ServerConfig(audio_round_ms=bad)


def test_serve_options_map_onto_one_settings_object():
    """The command line and Ray's key=value options build the same ``ServeSettings``; every option of ``serve``
    is one ``OPTIONS`` knows, and its defaults are the settings' own."""
    from chattts_velocity.audio.stream import StreamConfig
    from chattts_velocity.cli import build_parser, serve_settings
    from chattts_velocity.server.settings import OPTIONS, ServeSettings, parse_options

    def cli(*argv: str) -> ServeSettings:
        return serve_settings(build_parser().parse_args(["serve", *argv]))

    assert set(vars(build_parser().parse_args(["serve"]))) - {"command", "func"} == set(OPTIONS)
    assert cli() == ServeSettings.from_options({})
    assert cli().load == dict(source="huggingface", device=None, max_num_seqs=256, kv_cache_gib=None, engine_dtype=None,
                              max_window_tokens=2048)  # device and dtype: chosen where the model loads
    assert not cli().engine_process and cli().scale is None
    assert cli("--fronts", "3").engine_process  # more than one front: an engine process
    assert cli("--engine-process") == cli("--engine-process", "--fronts", "1")
    assert cli("--max-window-tokens", "0").load["max_window_tokens"] is None  # 0: no cap
    assert cli("--max-window-tokens", "4096").load["max_window_tokens"] == 4096
    assert cli().server.audio_thread and not cli("--no-audio-thread").server.audio_thread  # (on CUDA only)
    assert cli("--open-window-max-seqs", "0").load["open_window_max_seqs"] == 0  # (default: the engine's,
    assert "open_window_max_seqs" not in cli().load  # which checks the value: EngineConfig)
    assert "window_stops" not in cli().load  # the engine's default
    assert cli("--window-stops", "16,24").load["window_stops"] == (16, 24)
    assert cli("--window-stops", "none").load["window_stops"] == ()
    assert cli("--window-stops", "16,24") == ServeSettings.from_options(parse_options({"window_stops": "16,24"}))
    for bad in ("24,16", "16,x", "0"):  # said before the model loads
        with pytest.raises(ValueError, match="window_stops must be"):
            cli("--window-stops", bad)
    assert "window_budget_ms" not in cli().load  # the engine's default
    assert cli("--window-budget-ms", "500").load["window_budget_ms"] == 500.0
    assert cli("--window-budget-ms", "0").load["window_budget_ms"] is None  # 0: no budget
    assert cli("--window-budget-ms", "500") == ServeSettings.from_options(parse_options({"window_budget_ms": "500"}))
    with pytest.raises(ValueError, match="window_budget_ms must be a number > 0 or None"):
        cli("--window-budget-ms", "-5")
    assert "stream_config" not in cli().load  # the stream's default chunks
    assert cli("--stream-chunk", "48").load["stream_config"] == StreamConfig(chunk=48)
    assert cli("--stream-chunk", "48") == ServeSettings.from_options(parse_options({"stream_chunk": "48"}))
    with pytest.raises(ValueError, match="StreamConfig.chunk must be an int >= 1"):
        cli("--stream-chunk", "0")
    assert cli("--dummy", "--max-concurrent", "2") == ServeSettings.from_options(
        parse_options({"dummy": "true", "max_concurrent": 2}))
    with pytest.raises(ValueError, match="replica runs its engine in a process of its own already"):
        cli("--engine-process", "--replicas", "2")
    # with replicas, --fronts is each replica's, which only Serve's HAProxy ingress reaches; autoscaling counts
    # only a replica's own process's requests
    assert cli("--replicas", "2", "--fronts", "3", "--ingress", "haproxy").fronts == 3
    assert not cli("--replicas", "2", "--fronts", "3", "--ingress", "haproxy").engine_process
    with pytest.raises(ValueError, match="needs --ingress haproxy"):
        cli("--replicas", "2", "--fronts", "2", "--ingress", "proxy")
    with pytest.raises(ValueError, match="Serve's autoscaling counts only"):
        cli("--min-replicas", "1", "--max-replicas", "2", "--fronts", "2", "--ingress", "haproxy")
    with pytest.raises(ValueError, match="max_concurrent must be an int"):
        parse_options({"max_concurrent": "many"})
    with pytest.raises(ValueError, match="--model or --dummy"):
        ServeSettings.from_options({"model": "x", "dummy": True})
