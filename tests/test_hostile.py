"""The speech server against careless and hostile clients, one live server on 127.0.0.1 over a tiny checkpoint:
bodies past the cap (declared and chunked) are 413 before they are read, an hour-long voice sample is refused
from its header, unknown paths share one metrics series, a corrupt file in the voices folder is skipped, and a
500 closes its connection, a connection that sends its headers or body too slowly gets 408 and is closed, and
one connection past the cap is refused at once."""

from __future__ import annotations

import json
import select
import shutil
import socket
import time
import uuid

import httpx
import numpy as np
import pytest
import soundfile as sf
from server_helpers import API_KEY, ServerProcess, stalled_reader

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD_VOICE = "voice_0123456789abcdef"
CORRUPT_VOICE = "voice_fedcba9876543210"
MiB = 1 << 20
HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 12


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("voices")
    record = {"id": GOOD_VOICE, "name": "good", "spk_emb": None, "spk_smp": None, "txt_smp": None}
    (folder / f"{GOOD_VOICE}.json").write_text(json.dumps(record))
    (folder / f"{CORRUPT_VOICE}.json").write_text('{"id": "voice_fedcba98')  # a write cut short
    return folder


@pytest.fixture(scope="module")
def server(voices_dir, tmp_path_factory, upstream_ckpt):
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = ServerProcess(upstream_ckpt, "--max-new-token", "16", "--voices-dir", str(voices_dir), "--header-timeout",
                        str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S), "--max-connections",
                        str(MAX_CONNECTIONS), log_path=str(log))
    srv.log_file = log
    yield srv
    assert srv.stop() == 0


def _open(server, method: str, path: str, headers: dict[str, str]) -> socket.socket:
    """A raw connection that has sent a request's head (and none of its body)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}", *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    return sock


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the response on ``sock`` (the server closes it after)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed without a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def _assert_too_large(status: int, headers: dict, body: bytes) -> None:
    assert status == 413, (status, body)
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert headers.get("connection") == "close"


def test_a_declared_body_past_the_cap_is_413_unread_while_health_answers(server):
    sock = _open(server, "POST", "/v1/audio/speech", {**AUTH, "Content-Type": "application/json",
                                                      "Content-Length": str(2_000_000)})
    with sock:
        sock.sendall(b'{"input": "' + b"a" * 65536)  # a start of the body, and no more of it
        started = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        _assert_too_large(*_response(sock))
        assert time.monotonic() - started < 5


def test_a_chunked_body_is_cut_off_once_past_the_cap(server):
    sock = _open(server, "POST", "/v1/audio/speech", {**AUTH, "Content-Type": "application/json",
                                                      "Transfer-Encoding": "chunked"})
    chunk = b"[]," * (64 * 1024 // 3)
    with sock:
        sock.sendall(f"{len(chunk) + 1:x}\r\n[".encode() + chunk + b"\r\n")
        for _ in range(MiB // len(chunk) + 1):  # just past 1 MiB, and then the client waits: never the last chunk
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        _assert_too_large(*_response(sock))


def test_uploads_have_their_own_cap(server):
    sock = _open(server, "POST", "/v1/audio/voices", {**AUTH, "Content-Type": "multipart/form-data; boundary=x",
                                                      "Content-Length": str(17 * MiB)})
    with sock:
        _assert_too_large(*_response(sock))
    junk = np.random.default_rng(0).integers(0, 256, 2 * MiB, dtype=np.uint8).tobytes()  # past the body cap
    r = httpx.post(server.url + "/v1/audio/voices", headers=AUTH, files={"audio": ("x.wav", junk)},
                   data={"transcript": "hello"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio", r.text


def test_a_normal_request_still_works(server):
    r = httpx.post(server.url + "/v1/audio/speech", headers=AUTH, timeout=60,
                   json={"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_an_hour_long_sample_is_refused_from_its_header(server, tmp_path):
    path = tmp_path / "hour.flac"
    minute = np.zeros(24000 * 60, dtype=np.int16)
    with sf.SoundFile(str(path), "w", 24000, 1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(60):
            f.write(minute)
    data = path.read_bytes()
    assert len(data) < MiB  # silence: the file is small, its audio is not
    before = _rss_bytes(server.proc.pid)
    for _ in range(3):
        r = httpx.post(server.url + "/v1/audio/voices", headers=AUTH, files={"audio": ("hour.flac", data)},
                       data={"transcript": "hello"}, timeout=60)
        assert r.status_code == 400 and "60" in r.json()["error"]["message"], r.text
    assert _rss_bytes(server.proc.pid) - before < 100 * MiB


def _request_series(server) -> list[str]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith("chattts_requests_total{")]


def test_unknown_paths_share_one_metrics_series(server):
    before = _request_series(server)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for i in range(300):
            path = f"/{uuid.uuid4().hex}" if i % 3 == 0 else f"/v1/{uuid.uuid4().hex}"
            status = client.get(path, headers=AUTH if i % 3 == 1 else {}).status_code
            assert status in (401, 404), (path, status)
    after = _request_series(server)
    assert len(after) - len(before) <= 5, after
    assert any('route="other"' in line for line in after)
    assert any('route="/v1/audio/speech"' in line for line in after)  # a known route keeps its own


def test_a_corrupt_voice_file_is_skipped_with_a_warning_naming_it(server):
    r = httpx.get(server.url + "/v1/audio/voices", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    ids = [v["id"] for v in r.json()["voices"]]
    assert GOOD_VOICE in ids and CORRUPT_VOICE not in ids and "alloy" in ids
    assert f"{CORRUPT_VOICE}.json" in server.log_file.read_text()


def test_a_500_closes_its_connection(server, voices_dir):
    """An injected failure: the voices folder removed under the server, so listing it raises."""
    shutil.rmtree(voices_dir)
    r = httpx.get(server.url + "/v1/audio/voices", headers=AUTH, timeout=10)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert r.headers.get("connection") == "close"


def test_a_client_that_stops_reading_is_cut_off_and_its_slot_freed(upstream_ckpt):
    """One running slot, no queue: a client that sends a long request and reads nothing holds the slot only until
    ``--send-timeout``; then an honest client is served (not a 429)."""
    srv = ServerProcess(upstream_ckpt, "--max-concurrent", "1", "--max-queue", "0", "--send-timeout", "2",
                        "--max-new-token", "400", "--min-new-token", "400")
    text = " ".join(f"Sentence number {i} is spoken to a client that never reads it." for i in range(12))
    sock = stalled_reader(srv.url, {"model": "tts-1", "voice": "echo", "input": text, "response_format": "pcm"})
    honest = {"model": "tts-1", "voice": "echo", "input": "hi there", "response_format": "pcm"}
    try:
        deadline = time.monotonic() + 30
        while "chattts_running_requests 1.0" not in httpx.get(srv.url + "/metrics").text:
            assert time.monotonic() < deadline, "the stalled request never started"
            time.sleep(0.1)
        busy = httpx.post(srv.url + "/v1/audio/speech", json=honest, headers=AUTH, timeout=30)
        assert busy.status_code == 429  # the stalled client holds the one slot
        deadline, served = time.monotonic() + 40, None
        while served is None and time.monotonic() < deadline:
            r = httpx.post(srv.url + "/v1/audio/speech", json=honest, headers=AUTH, timeout=30)
            served = r if r.status_code == 200 else None
            time.sleep(0.5)
        assert served is not None and served.content, "the slot was never given back"
    finally:
        sock.close()
        srv.stop()


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=15)


def _assert_timed_out(sock: socket.socket, started: float, within: float) -> None:
    status, headers, body = _response(sock)
    assert status == 408, (status, body)
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert headers.get("connection") == "close"
    assert time.monotonic() - started < within
    assert sock.recv(1) == b""  # and closed


def test_a_connection_that_sends_nothing_gets_408_and_is_closed(server):
    started = time.monotonic()
    with _connect(server) as sock:
        _assert_timed_out(sock, started, HEADER_TIMEOUT_S + 3)
        assert time.monotonic() - started >= HEADER_TIMEOUT_S - 0.1


def test_headers_sent_a_byte_at_a_time_get_408_by_the_deadline(server):
    head = f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n".encode()
    started = time.monotonic()
    with _connect(server) as sock:
        for i in range(len(head)):  # a byte every 0.2 s: the whole head would take far past the deadline
            try:
                sock.sendall(head[i:i + 1])
            except OSError:  # closed under us: the response is waiting
                break
            if select.select([sock], [], [], 0.2)[0]:
                break
        _assert_timed_out(sock, started, HEADER_TIMEOUT_S + 3)


def test_a_kept_alive_connection_has_the_deadline_for_its_next_request(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = _response(sock)
        assert status == 200
        time.sleep(HEADER_TIMEOUT_S + 0.5)  # idle between requests: the keep-alive timeout's, not this one
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(sock)[0] == 200
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # the third request's head, never finished
        _assert_timed_out(sock, started, HEADER_TIMEOUT_S + 3)


def test_a_body_that_trickles_gets_408(server):
    payload = json.dumps({"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm"})
    sock = _open(server, "POST", "/v1/audio/speech", {**AUTH, "Content-Type": "application/json",
                                                      "Content-Length": str(len(payload))})
    started = time.monotonic()
    with sock:
        for i in range(len(payload)):  # a byte every 0.2 s: the body would take far past its deadline
            sock.sendall(payload[i:i + 1].encode())
            if select.select([sock], [], [], 0.2)[0]:
                break
        status, headers, body = _response(sock)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout", (status, body)
        assert headers.get("connection") == "close"
        assert BODY_TIMEOUT_S - 0.1 <= time.monotonic() - started < BODY_TIMEOUT_S + 3
    assert 'status="408"' in "".join(_request_series(server))


def test_a_connection_past_the_cap_is_refused_at_once(server):
    socks = [_connect(server) for _ in range(MAX_CONNECTIONS + 1)]
    try:
        time.sleep(0.5)
        refused = [s for s in socks if select.select([s], [], [], 0)[0]]
        assert len(refused) == 1, f"{len(refused)} of {len(socks)} connections answered before the deadline"
        status, headers, body = _response(refused[0])
        assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections", (status, body)
        assert headers.get("connection") == "close"
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.3)  # the server sees them close
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
