"""``serve --fronts 2``: two HTTP front processes over one engine process on one port. Both take connections,
admission limits hold over both, ``/metrics`` counts every front's requests whichever answers, a voice
registered through one is known to the other, a front that dies is replaced (its requests aborted, its
admission counts zeroed; the new one knows the voices registered before it), and SIGTERM drains every front
and exits 0."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import threading
import time
import wave

import httpx
import numpy as np
import pytest
from server_helpers import API_KEY, ServerProcess, connection_owner, engine_processes, listening_pids, metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKENS = 120
LONG = " ".join(f"Sentence number {i} of a request that takes a while." for i in range(8))


def body(text: str = "One short sentence.", seed: int = 1, voice: str = "echo") -> dict:
    return {"model": "tts-1", "voice": voice, "input": text, "response_format": "pcm", "seed": seed}


@pytest.fixture(scope="module")
def server(upstream_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = ServerProcess(upstream_ckpt, "--fronts", "2", "--max-new-token", str(TOKENS), "--min-new-token",
                        str(TOKENS), "--max-concurrent", "1", "--max-queue", "1", log_path=str(log))
    srv.log_path = log
    srv.fronts = []
    deadline = time.monotonic() + 60
    while len(srv.fronts) < 2:  # the second front listens once it has the engine's kit
        assert time.monotonic() < deadline, "the second front did not start listening"
        srv.fronts = listening_pids([srv.proc.pid, *engine_processes(srv.proc.pid)], srv.port)
        time.sleep(0.2)
    yield srv
    srv.stop()


def speech_count(url: str, status: int) -> float:
    return metric(url, f'chattts_requests_total{{route="/v1/audio/speech",status="{status}"}}', AUTH, default=0)


def test_both_fronts_take_connections_and_metrics_count_them_all(server):
    before = speech_count(server.url, 200)
    owners, sizes = set(), set()
    for seed in range(12):  # a client (and connection) each: the kernel spreads them over the fronts
        with httpx.Client(timeout=60) as client:
            r = client.post(server.url + "/v1/audio/speech", json=body(seed=seed % 2), headers=AUTH)
            client_port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
            owners.add(connection_owner(server.fronts, server.port, client_port))
        assert r.status_code == 200
        sizes.add(len(r.content))
    assert owners == set(server.fronts)
    assert sizes == {(2 * TOKENS - 1) * 256 * 2}
    for _ in range(6):  # whichever front answers /metrics sums both
        assert speech_count(server.url, 200) - before == 12


def test_admission_limits_hold_over_both_fronts(server):
    async def burst():
        limits = httpx.Limits(max_keepalive_connections=0)  # a connection each
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(client.post(server.url + "/v1/audio/speech", json=body(LONG, seed=i),
                                                      headers=AUTH) for i in range(12)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 2 + [429] * 10  # one running and one queued, over both fronts together
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
    assert len({len(r.content) for r in responses if r.status_code == 200}) == 1  # the queued one ran in full
    assert metric(server.url, "chattts_running_requests", AUTH) == 0
    assert metric(server.url, "chattts_queue_depth", AUTH) == 0


def make_sample() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes((np.sin(np.arange(36000) / 7) * 9000).astype("<i2").tobytes())
    return buf.getvalue()


def test_a_voice_registered_through_one_front_is_known_to_both(server):
    r = httpx.post(server.url + "/v1/audio/voices", headers=AUTH, timeout=60, data={"transcript": "a sample"},
                   files={"audio": ("sample.wav", make_sample(), "audio/wav")})
    assert r.status_code == 201
    vid = server.voice = r.json()["id"]
    for seed in range(8):  # fresh connections: both fronts, w.h.p.
        listed = httpx.get(server.url + "/v1/audio/voices", headers=AUTH, timeout=10).json()["voices"]
        assert vid in {v["id"] for v in listed}
        r = httpx.post(server.url + "/v1/audio/speech", json=body(seed=seed, voice=vid), headers=AUTH, timeout=60)
        assert r.status_code == 200 and len(r.content) > 0


def _connection_to(server, pid: int) -> httpx.Client:
    """A client whose kept-alive connection the front ``pid`` holds."""
    for _ in range(60):
        client = httpx.Client(timeout=60)
        r = client.get(server.url + "/health")
        if connection_owner(server.fronts, server.port, r.extensions["network_stream"].get_extra_info("client_addr")[1]) == pid:
            return client
        client.close()
    pytest.fail(f"no connection reached front {pid}")


def test_a_front_that_dies_is_replaced_its_requests_aborted(server):
    voice = server.voice  # registered through one front, in memory (no voices folder)
    child = next(pid for pid in server.fronts if pid != server.proc.pid)
    client = _connection_to(server, child)
    with client.stream("POST", server.url + "/v1/audio/speech", json=body(LONG), headers=AUTH) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()
        next(chunks)  # generating, holding the one running slot
        os.kill(child, signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):  # its response is cut off
            for _ in chunks:
                pass
    client.close()
    deadline = time.monotonic() + 20
    while metric(server.url, "chattts_running_requests", AUTH) or metric(server.url, "chattts_kv_blocks_used", AUTH):
        assert time.monotonic() < deadline, "the dead front's slot or its engine requests were kept"
        time.sleep(0.2)
    deadline = time.monotonic() + 90
    while True:  # a new front process takes its place on the port
        fronts = listening_pids([server.proc.pid, *engine_processes(server.proc.pid)], server.port)
        if len(fronts) == 2 and child not in fronts:
            break
        assert time.monotonic() < deadline, f"no front replaced the dead one: {fronts}"
        time.sleep(0.2)
    server.fronts = fronts
    new = next(pid for pid in fronts if pid != server.proc.pid)
    client = _connection_to(server, new)
    try:  # the new front serves, with the voice registered before it
        r = client.post(server.url + "/v1/audio/speech", json=body(voice=voice), headers=AUTH)
        assert r.status_code == 200 and len(r.content) > 0
        assert voice in {v["id"] for v in client.get(server.url + "/v1/audio/voices", headers=AUTH).json()["voices"]}
    finally:
        client.close()
    assert "exited with -9: started a new one" in server.log_path.read_text()


def test_sigterm_to_every_process_drains_the_fronts_and_exits_0(server):
    """SIGTERM to every process of the server, as a service manager's stop (systemd signals every process of a
    service) or a ``kill`` of the process group sends it: the other front ignores it and drains on the first
    front's word (``FRONT_SIGNAL``; with both signals it cut its streams off and logged tracebacks), so a stream
    in flight on it and one queued behind it finish, a late request is refused, and the server exits 0."""
    fronts = listening_pids([server.proc.pid, *engine_processes(server.proc.pid)], server.port)
    child = next(pid for pid in fronts if pid != server.proc.pid)
    pinned, other = _connection_to(server, child), httpx.Client(timeout=120)
    results: dict[str, httpx.Response | BaseException] = {}
    last: dict[str, float] = {}  # when each stream's latest bytes came
    started = threading.Event()

    def stream(name: str, client: httpx.Client, seed: int) -> None:
        try:
            with client.stream("POST", server.url + "/v1/audio/speech", json=body(LONG, seed=seed),
                               headers=AUTH) as r:
                data = b""
                for chunk in r.iter_bytes():
                    data += chunk
                    started.set()
                    last[name] = time.monotonic()
                results[name] = r, data
        except BaseException as e:  # noqa: BLE001 - asserted below
            results[name] = e

    threads = [threading.Thread(target=stream, args=("on the other front", pinned, 1)),
               threading.Thread(target=stream, args=("queued", other, 2))]
    threads[0].start()
    assert started.wait(60), "no audio came"
    threads[1].start()
    time.sleep(0.05)
    for pid in [child, *engine_processes(server.proc.pid)]:  # theirs first: the first front's word comes after
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.1)
    os.kill(server.proc.pid, signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.3)
    try:
        late = httpx.post(server.url + "/v1/audio/speech", json=body(), headers=AUTH, timeout=30).status_code
    except httpx.ConnectError:  # the listening sockets are closed already
        late = "refused"
    for t in threads:
        t.join(120)
    pinned.close()
    other.close()
    assert server.proc.wait(60) == 0
    sizes = set()
    for name, result in results.items():
        assert not isinstance(result, BaseException), f"{name}: {result!r}"
        response, data = result
        assert response.status_code == 200, name
        sizes.add(len(data))
    assert len(results) == 2 and len(sizes) == 1 and sizes.pop() > 0  # both in full (equal lengths: forced)
    assert last["on the other front"] > signalled, "the signal came after that stream: it was not in flight"
    assert late in (503, "refused")
    assert engine_processes(server.proc.pid) == []
    assert "Traceback" not in server.log_path.read_text()
