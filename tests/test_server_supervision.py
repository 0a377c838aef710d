"""A supervised engine process (``serve --fronts 2``, a short ``--engine-timeout``): an engine process that hangs
(SIGSTOP) makes ``/health`` 503 within the timeout while the fronts go on answering (``/v1/models``, ``/health``,
``/metrics`` never block, even with requests' commands piling up for it), new speech requests are refused
with 503, and once it resumes every request it held completes and ``/health`` is ok again. A front process
that dies is replaced, but one that keeps dying stops the server with exit 1, for its supervisor."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import API_KEY, ServerProcess, engine_processes, listening_pids

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ENGINE_TIMEOUT_S = 2.0
TOKENS = 24
# a long input: each request's Start carries many sentences' prompts, so six of them overfill the pipe's buffer
LONG = " ".join(f"Sentence number {i} of a long request, with a few more words in it." for i in range(60))


def body(text: str = "One short sentence.", seed: int = 1) -> dict:
    return {"model": "tts-1", "voice": "echo", "input": text, "response_format": "pcm", "seed": seed}


@pytest.fixture(scope="module")
def server(upstream_ckpt):
    srv = ServerProcess(upstream_ckpt, "--fronts", "2", "--engine-timeout", str(ENGINE_TIMEOUT_S),
                        "--max-new-token", str(TOKENS), "--min-new-token", str(TOKENS))
    deadline = time.monotonic() + 60
    while True:  # the second front listens once it has the engine's kit
        children = engine_processes(srv.proc.pid)
        fronts = listening_pids([srv.proc.pid, *children], srv.port)
        if len(fronts) == 2:
            break
        assert time.monotonic() < deadline, "the second front did not start listening"
        time.sleep(0.2)
    srv.engine = next(pid for pid in children if pid not in fronts)
    srv.fronts = fronts
    yield srv
    srv.stop()


def _timed_get(url: str, timeout: float = 3.0) -> tuple[int, float, dict]:
    start = time.monotonic()
    r = httpx.get(url, headers=AUTH, timeout=timeout)
    return r.status_code, time.monotonic() - start, r.json() if r.headers.get("content-type") == "application/json" else {}


def test_a_hung_engine_process_is_unhealthy_while_the_fronts_answer_and_nothing_is_lost(server):
    assert _timed_get(server.url + "/health")[0] == 200
    os.kill(server.engine, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(6) as pool:
            # six long requests whose commands the stopped engine process never reads
            futures = [pool.submit(httpx.post, server.url + "/v1/audio/speech", json=body(LONG, seed=i),
                                   headers=AUTH, timeout=120) for i in range(6)]
            time.sleep(1.0)
            for path in ("/v1/models", "/health"):
                for _ in range(4):  # fresh connections: both fronts, most likely
                    status, took, _ = _timed_get(server.url + path)
                    assert took < 1.5, f"{path} took {took:.1f} s with the engine process stopped"
            deadline = time.monotonic() + ENGINE_TIMEOUT_S + 5
            while True:
                status, took, answer = _timed_get(server.url + "/health")
                assert took < 1.5
                if status == 503:
                    break
                assert time.monotonic() < deadline, "/health stayed ok with the engine process stopped"
                time.sleep(0.2)
            assert "has not answered" in answer["status"], answer
            status, took, answer = _timed_get(server.url + "/metrics", timeout=15)
            assert status == 503 and took < 10, (status, took)
            r = httpx.post(server.url + "/v1/audio/speech", json=body(seed=99), headers=AUTH, timeout=10)
            assert r.status_code == 503 and "has not answered" in r.json()["error"]["message"]
            assert not any(f.done() for f in futures), "a request ended while the engine process was stopped"
            os.kill(server.engine, signal.SIGCONT)
            responses = [f.result() for f in futures]
    finally:
        os.kill(server.engine, signal.SIGCONT)
    assert [r.status_code for r in responses] == [200] * 6
    assert all(len(r.content) > 0 for r in responses)
    deadline = time.monotonic() + 10
    while _timed_get(server.url + "/health")[0] != 200:
        assert time.monotonic() < deadline, "/health did not recover once the engine process resumed"
        time.sleep(0.2)
    r = httpx.post(server.url + "/v1/audio/speech", json=body(seed=7), headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.content) > 0


def _other_front(server, not_pid: int | None = None, timeout: float = 90) -> int:
    """The listening front other than the server's own process (waiting for it, and for it not to be
    ``not_pid``)."""
    deadline = time.monotonic() + timeout
    while True:
        fronts = listening_pids([server.proc.pid, *engine_processes(server.proc.pid)], server.port)
        others = [pid for pid in fronts if pid != server.proc.pid and pid != not_pid]
        if others:
            return others[0]
        assert server.proc.poll() is None, f"the server exited with {server.proc.returncode}"
        assert time.monotonic() < deadline, "no second front is listening"
        time.sleep(0.2)


def test_a_front_that_keeps_dying_stops_the_server_with_exit_1(server):
    child = _other_front(server)
    for _ in range(2):  # replaced each time
        os.kill(child, signal.SIGKILL)
        child = _other_front(server, not_pid=child)
    assert httpx.post(server.url + "/v1/audio/speech", json=body(), headers=AUTH, timeout=60).status_code == 200
    os.kill(child, signal.SIGKILL)  # its third death within a minute: the server drains and exits 1
    assert server.proc.wait(60) == 1
