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


def test_sigterm_drains_the_fronts_and_exits_0(server):
    async def in_flight():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            first = asyncio.create_task(client.post(server.url + "/v1/audio/speech", json=body(LONG, seed=1),
                                                    headers=AUTH))
            queued = asyncio.create_task(client.post(server.url + "/v1/audio/speech", json=body(LONG, seed=2),
                                                     headers=AUTH))
            await asyncio.sleep(0.5)
            server.terminate()
            await asyncio.sleep(0.3)
            try:
                late = (await client.post(server.url + "/v1/audio/speech", json=body(), headers=AUTH)).status_code
            except httpx.ConnectError:  # the listening socket is closed already
                late = "refused"
            return await first, await queued, late

    first, queued, late = asyncio.run(in_flight())
    assert first.status_code == queued.status_code == 200
    assert len(first.content) == len(queued.content) > 0
    assert late in (503, "refused")
    assert server.proc.wait(60) == 0
    assert engine_processes(server.proc.pid) == []
