"""A Ray Serve replica's HTTP front processes (``server/replica_fronts.py``), without Ray: the replica's part is
played here (its engine process, a server on a listening socket bound as Serve binds it, without
``SO_REUSEPORT``, and a desk that answers as the cluster would). Once the socket is handed over the fronts accept
on it and this process stops; they answer Serve's probes, add each other's metrics up, and drain with the
replica. The whole thing under Ray is ``test_scale.py``."""

from __future__ import annotations

import socket
import threading
import time

import httpx
from prometheus_client import Metric
from server_helpers import API_KEY, listening_pids

from chattts_velocity.server import ServerConfig
from chattts_velocity.server.admission import shared_counts
from chattts_velocity.server.app import build_app
from chattts_velocity.server.replica_fronts import (
    FRONT_HEADER,
    REPLICA_HEADER,
    ReplicaClient,
    ReplicaFronts,
    ReplicaHeader,
    ServeProbes,
    find_listener,
)
from chattts_velocity.server.run import _admission
from chattts_velocity.serving.engine_process.host import EngineSettings

AUTH = {"Authorization": f"Bearer {API_KEY}"}


class FakeLink:
    """The replica's link to the cluster: voices in a dict, one other replica's metrics."""

    def __init__(self):
        self.records: dict[str, dict] = {}
        self.voices = self
        other = Metric("chattts_requests", "HTTP requests by route and status", "counter")
        other.add_sample("chattts_requests_total", {"route": "/v1/audio/speech", "status": "200", "replica": "other"},
                         5.0)
        self.other = [other]
        self.stopped = False

    def put(self, record: dict) -> None:
        self.records[record["id"]] = record

    def all(self) -> list[dict]:
        return list(self.records.values())

    def peers(self) -> list[list[Metric]]:
        return [self.other]

    def stop(self) -> None:
        self.stopped = True


def test_find_listener_finds_a_listening_socket_by_its_port_range():
    with socket.socket() as listening, socket.socket() as bound_only:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        bound_only.bind(("127.0.0.1", 0))
        port, other = listening.getsockname()[1], bound_only.getsockname()[1]
        assert find_listener(range(port, port + 1)) == listening.fileno()
        assert find_listener(range(other, other + 1)) is None  # bound, not listening
    assert find_listener(range(port, port + 1)) is None  # closed


def serve_in_thread(app, sock: socket.socket):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    return server


def speech(url: str, seed: int = 0) -> httpx.Response:
    with httpx.Client(timeout=60) as fresh:  # a connection of its own: the kernel picks the front that accepts it
        return fresh.post(url + "/v1/audio/speech", headers=AUTH, json={
            "model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm", "seed": seed})


def test_a_replicas_fronts_take_over_its_socket_and_serve_within_its_limits(upstream_ckpt):
    config = ServerConfig(max_concurrent=2, max_queue=1, max_new_token=24, api_key=API_KEY, shutdown_timeout_s=20)
    load = {"source": "custom", "custom_path": upstream_ckpt, "device": "cpu"}
    link = FakeLink()
    client = ReplicaClient.start_engine(load, EngineSettings(audio_round_ms=0, log_level="warning"), fronts=3,
                                        link=link, replica="r1", front_count=3)
    counts = shared_counts(3)
    fronts = server = None
    listening = socket.socket()  # as Serve's replica server binds it: no SO_REUSEPORT
    try:
        client.wait_ready(300)
        fronts = ReplicaFronts(client, config, counts, "r1", "app",
                               desk={"put": link.put, "all": link.all, "peers": link.peers}, log_level="warning")
        pids = [process.pid for process, _, _ in fronts.fronts]
        assert len(pids) == 2
        listening.bind(("127.0.0.1", 0))
        listening.listen(64)
        port = listening.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        app = build_app(client, config, _admission(config, counts, 0), metric_labels={"replica": "r1"})
        app.add_middleware(ServeProbes, client=client, app_name="app")  # what Serve's server answers itself
        app.add_middleware(ReplicaHeader, replica="r1")
        server = serve_in_thread(app, listening)
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert speech(url).headers[FRONT_HEADER] == "0"  # before the hand-over: this process serves
        fronts.hand_over(lambda: find_listener(range(port, port + 1)), timeout_s=30)
        deadline = time.monotonic() + 120
        while len(listening_pids(pids, port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert listening_pids(pids, port) == pids  # the very socket: a port of their own would not be this one
        assert listening.fileno() == -1  # this process's server closed its descriptor, and accepts no more

        served = []
        for seed in range(40):
            r = speech(url, seed)
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] == "r1" and len(r.content) > 0
            served.append(r.headers[FRONT_HEADER])
            if set(served) == {"1", "2"}:
                break
        assert set(served) == {"1", "2"}, served
        with httpx.Client(timeout=60) as http:
            # Serve's probes, as HAProxy sends them
            probe = http.get(url + "/-/healthz")
            assert probe.headers[FRONT_HEADER] in ("1", "2") and (probe.status_code, probe.text) == (200, "success")
            assert http.get(url + "/-/routes").json() == {"/": "app"}
            # /metrics from either front: every front's requests, and the other replica's beside them
            text = http.get(url + "/metrics").text
        assert 'chattts_requests_total{replica="other",route="/v1/audio/speech",status="200"} 5.0' in text
        ok = [line for line in text.splitlines()
              if line.startswith('chattts_requests_total{replica="r1",route="/v1/audio/speech",status="200"}')]
        assert len(ok) == 1 and float(ok[0].rsplit(" ", 1)[1]) == len(served) + 1, (ok, served)
        assert fronts.health() is None
        # the replica drains: its fronts answer new speech 503
        fronts.drain()
        assert {speech(url).status_code for _ in range(6)} == {503}
        fronts.close(config.shutdown_timeout_s)
        assert [process.exitcode for process, _, _ in fronts.fronts] == [0, 0] and fronts.health() is not None
        fronts = None
    finally:
        if fronts is not None:
            fronts.close(5)
        if server is not None:
            server.should_exit = True
        listening.close()
        client.close()
    assert link.stopped


def test_fronts_that_get_no_socket_exit_and_the_replica_serves_alone(upstream_ckpt):
    config = ServerConfig(max_new_token=24)
    load = {"source": "custom", "custom_path": upstream_ckpt, "device": "cpu"}
    link = FakeLink()
    client = ReplicaClient.start_engine(load, EngineSettings(audio_round_ms=0, log_level="warning"), fronts=2,
                                        link=link, replica="r1", front_count=2)
    try:
        client.wait_ready(300)
        fronts = ReplicaFronts(client, config, shared_counts(2), "r1", "app", desk={}, log_level="warning")
        fronts.hand_over(lambda: None, timeout_s=0.2)
        (front,) = [process for process, _, _ in fronts.fronts]
        front.join(120)
        assert front.exitcode == 0 and fronts.alone and fronts.health() is None
        fronts.close(5)
    finally:
        client.close()
