"""``serve --engine-process``: what the process split adds to the server tests run in both modes
(`test_server.py`, `test_server_shutdown.py`): a client that leaves has its engine requests aborted across the
pipe, ``--min-new-token`` holds every request to one length, and a dead engine process cuts off the requests in
flight and makes the server exit 1 (its supervisor restarts it). The engine process's
seam itself (messages, pipes, ``RemoteClient``) is tested in `test_engine_process.py`."""

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


def test_a_dead_engine_process_cuts_off_its_streams_and_the_server_exits_1(server):
    """Nothing can be generated once the engine process is gone: the bodies in flight break (never a short body
    that looks whole) and the server exits 1 at once, for its supervisor to restart it, instead of answering 503
    for ever."""
    (engine,) = engine_processes(server.proc.pid)
    text = " ".join(f"Sentence {i} is cut off when the engine process dies." for i in range(6))
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body(text), headers=AUTH, timeout=60) as r:
        chunks = r.iter_bytes()
        got = len(next(chunks))
        os.kill(engine, signal.SIGKILL)
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            for chunk in chunks:
                got += len(chunk)
    assert 0 < got < 6 * (2 * TOKENS - 1) * 256 * 2  # s16le: the whole body would be every sentence's samples
    assert server.proc.wait(30) == 1


def test_engine_process_and_replicas_do_not_combine(tmp_path):
    import subprocess
    import sys

    for flag, said in ((["--engine-process"], "--engine-process"), (["--fronts", "2", "--ingress", "proxy"],
                                                                    "needs --ingress haproxy")):
        run = subprocess.run([sys.executable, "-m", "chattts_velocity.cli", "serve", "--model", str(tmp_path),
                              *flag, "--replicas", "2"], capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and said in run.stderr and "Traceback" not in run.stderr


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
