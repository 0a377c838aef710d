"""SIGTERM with requests in flight: they finish with all their audio, new requests get 503 meanwhile, and the
process exits 0 (with ``--engine-process``, its engine process exits too)."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from server_helpers import API_KEY, ServerProcess, engine_processes, stalled_reader

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def body(seed: int) -> dict:
    text = " ".join(f"Sentence number {i} must still be spoken while the server stops." for i in range(8))
    return {"model": "tts-1", "voice": "echo", "input": text, "response_format": "pcm", "seed": seed}


@pytest.mark.parametrize("split", [False, True], ids=["one-process", "engine-process"])
def test_sigterm_drains_in_flight_requests(upstream_ckpt, split):
    # every sentence 160 tokens: the three in flight take about a second after their first audio here, where
    # requests that ended early (random weights) let the drain finish before the late request came
    srv = ServerProcess(upstream_ckpt, "--max-new-token", "160", "--min-new-token", "160", "--shutdown-timeout", "60",
                        *(["--engine-process"] if split else []))
    engines = engine_processes(srv.proc.pid)
    assert len(engines) == int(split)
    alone = {seed: len(httpx.post(srv.url + "/v1/audio/speech", json=body(seed), headers=AUTH, timeout=60).content)
             for seed in range(3)}
    sizes, started = {}, threading.Semaphore(0)

    def stream(seed):
        with httpx.stream("POST", srv.url + "/v1/audio/speech", json=body(seed), headers=AUTH, timeout=60) as r:
            total, first = 0, True
            for chunk in r.iter_bytes():
                total += len(chunk)
                if first:
                    started.release()
                    first = False
            sizes[seed] = (r.status_code, total)

    threads = [threading.Thread(target=stream, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60)
    srv.terminate()
    deadline = time.monotonic() + 10
    while httpx.get(srv.url + "/health").status_code != 503:  # the signal taken: draining
        assert time.monotonic() < deadline, "/health never said the server is stopping"
        time.sleep(0.02)
    late = httpx.post(srv.url + "/v1/audio/speech", json=body(9), headers=AUTH, timeout=10)
    assert late.status_code == 503 and late.headers.get("retry-after") and late.json()["error"]["message"]
    for t in threads:
        t.join(60)
    assert sizes == {seed: (200, alone[seed]) for seed in range(3)}, (sizes, alone)
    assert srv.proc.wait(60) == 0
    srv.stop()
    for pid in engines:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), "the engine process outlived the server"


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_shutdown_ends_with_a_reader_that_stalls_and_a_second_signal_ends_it_at_once(upstream_ckpt):
    """``--shutdown-timeout`` bounds the drain even when a client stopped reading; a second SIGTERM does not wait
    for the drain at all. Both exit 0."""
    for timeout_s, signals in (("2", 1), ("600", 2)):
        srv = ServerProcess(upstream_ckpt, "--max-new-token", "400", "--min-new-token", "400",
                            "--shutdown-timeout", timeout_s)
        sock = stalled_reader(srv.url, body(1))
        try:
            deadline = time.monotonic() + 30
            while httpx.get(srv.url + "/metrics").text.find("chattts_running_requests 1.0") < 0:
                assert time.monotonic() < deadline, "the stalled request never started"
                time.sleep(0.1)
            start = time.monotonic()
            for _ in range(signals):
                srv.terminate()
                time.sleep(0.5)
            assert srv.proc.wait(30) == 0
            assert time.monotonic() - start < 20
        finally:
            sock.close()
            srv.stop()
