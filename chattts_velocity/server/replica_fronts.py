"""A Ray Serve replica's HTTP fronts (``serve --replicas N --fronts F``): F front processes over the replica's
engine process, as ``serve --fronts`` runs them on one machine, while the replica's own process keeps Serve's side
(health checks, reports, the cluster's voices and metrics) and no longer serves HTTP.

Serve's HAProxy hands each connection to the replica's own HTTP server (direct ingress), which Serve binds
without ``SO_REUSEPORT``: the fronts cannot bind its port, so they take over its listening socket instead. Once
Serve's server listens, the replica finds that socket among its own (``find_listener``) and sends it to each
front (``ReplicaFronts.hand_over``); once they accept on it, the replica's server stops (``stop_serving``; the
connections it accepted go on), so there is no instant without a listener. The kernel wakes the fronts waiting in
``accept`` for each new connection, and one busy with its streams takes fewer. The fronts admit against the replica's one set of limits
(``shared_counts``); each answers Serve's ``/-/healthz`` and ``/-/routes`` (HAProxy's health checks); what only a
Ray worker can reach (the shared voices, the other replicas' metrics) a front asks its replica for over a pipe
(``Desk``).

A front whose replica dies is killed with it (``PR_SET_PDEATHSIG``), so that the engine process, with every front
gone, exits and frees its GPU for the replica Serve starts in its place; a replica stopping on its own drains its
fronts first (SIGTERM). Ray is not imported here: the front processes never import it."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np
import uvicorn
from prometheus_client import Metric

from ..gc_freeze import freeze_long_lived
from ..serving.engine_process.messages import FrontEnds
from ..serving.engine_process.remote import RemoteClient
from ..serving.voices import Voice
from .app import build_app
from .metrics import labelled
from .run import _admission, _die_with_parent, _run_front, _server, order
from .settings import ServerConfig

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-chattts-replica"
"""Response header naming the replica that answered (its Serve replica id)."""
FRONT_HEADER = "x-chattts-front"
"""Response header naming the replica's front process that answered (0: the replica's own)."""
SERVE_PROBES = ("/-/healthz", "/-/routes")
"""The paths Serve's replica server answers itself: HAProxy's health checks and route table."""
ACCEPTING = "accepting"
"""What a front tells its replica once its server accepts on the handed socket."""
LISTENER_WAIT_S = 120.0
"""How long the replica looks for Serve's listening socket (and then waits for its fronts to accept on it)."""


class ReplicaHeader:
    """Adds ``x-chattts-replica: <replica id>`` and ``x-chattts-front: <index>`` to every response (which engine
    and which of its fronts served a request)."""

    def __init__(self, app, replica: str, front: int = 0):
        self.app = app
        self.headers = [(REPLICA_HEADER.encode(), replica.encode()), (FRONT_HEADER.encode(), str(front).encode())]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        await self.app(scope, receive, named)


class ServeProbes:
    """Answers ``/-/healthz`` and ``/-/routes`` as Serve's replica server does (200, or 503 with why while the
    engine process is unhealthy), ahead of the app's limits and key: a front other than the replica's own gets
    HAProxy's health checks too."""

    def __init__(self, app, client: RemoteClient, app_name: str, route_prefix: str = "/"):
        self.app, self.client, self.routes = app, client, {route_prefix: app_name}

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path not in SERVE_PROBES:
            await self.app(scope, receive, send)
            return
        why = self.client.health()
        if why is not None:
            status, body = 503, why.encode()
        elif path == "/-/routes":
            status, body = 200, json.dumps(self.routes).encode()
        else:
            status, body = 200, b"success"
        kind = b"application/json" if path == "/-/routes" and why is None else b"text/plain; charset=utf-8"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def stop_serving(fd: int) -> int:
    """Have this process's uvicorn servers stop accepting on socket ``fd`` (each on its own loop; the
    connections they accepted go on), closing their descriptor of it: processes it was handed to keep the socket
    listening. Returns how many servers stopped."""
    stopped = 0
    frozen = gc.get_freeze_count() > 0  # Serve freezes a replica's objects once it started: the collector's
    if frozen:                          # list leaves them out until they are thawed
        gc.unfreeze()
    try:
        servers = [o for o in gc.get_objects() if isinstance(o, uvicorn.Server)]
    finally:
        if frozen:
            gc.freeze()
    for server in servers:
        for listener in getattr(server, "servers", None) or ():
            if any(sock.fileno() == fd for sock in listener.sockets):
                listener.get_loop().call_soon_threadsafe(listener.close)
                stopped += 1
    return stopped


def find_listener(ports: range) -> int | None:
    """The descriptor of this process's listening TCP socket whose port is within ``ports`` (Serve's replica
    server), or None while there is none."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile, or not a socket after all
            continue
        with sock:
            try:
                if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                        and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                        and sock.getsockname()[1] in ports):
                    return fd
            except OSError:
                continue
    return None


class Desk:
    """A front's line to its replica's process, for what only a Ray worker reaches: the shared voices (a
    ``VoiceRegistry``'s ``SharedVoices``) and the other replicas' latest metrics. Blocking calls, from worker
    threads."""

    def __init__(self, conn):
        self.conn, self._lock = conn, threading.Lock()
        self.voices = self
        """As ``ReplicaLink.voices``: the store's ``put`` and ``all``."""

    def _ask(self, op: str, *args):
        with self._lock:
            self.conn.send((op, args))
            ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"the replica could not answer {op}: {value}")
        return value

    def put(self, record: dict) -> None:
        self._ask("put", record)

    def all(self) -> list[dict]:
        return self._ask("all")

    def peers(self) -> list[list[Metric]]:
        """The other replicas' latest families, each labelled with its replica."""
        return self._ask("peers")

    def stop(self) -> None:
        self.conn.close()


class ReplicaClient(RemoteClient):
    """A replica front's handle on its engine process, with the cluster plugged in through ``link`` (the
    replica's ``cluster.ReplicaLink``, or a ``Desk`` to it): the voices it registers go to the shared store too
    (and other replicas' are found there), and ``peer_metrics`` are this replica's other fronts' series (labelled
    as this front's, so that they add up) and the other replicas'. ``close`` stops the link too."""

    def __init__(self, ends, *, link, replica: str, front_count: int = 1, **kw):
        """``front_count``: the replica's fronts (this one's siblings answer through the engine process)."""
        super().__init__(ends, shared_voices=link.voices, **kw)
        self.link, self.replica, self.front_count = link, replica, front_count

    async def register_voice(self, name: str, wav: np.ndarray, transcript: str) -> Voice:
        voice = await super().register_voice(name, wav, transcript)
        await asyncio.to_thread(self.link.voices.put, asdict(voice))  # a blocking call to the store
        return voice

    async def sibling_metrics(self) -> list[list[Metric]]:
        """This replica's other fronts' own families, unlabelled."""
        return await super().peer_metrics() if self.front_count > 1 else []

    async def peer_metrics(self) -> list[list[Metric]]:
        siblings = [labelled(f, {"replica": self.replica}) for f in await self.sibling_metrics()]
        return siblings + await asyncio.to_thread(self.link.peers)

    def close(self, timeout: float = 30.0) -> None:
        self.link.stop()
        super().close(timeout)


class ReplicaFronts:
    """A replica's front processes, over the engine process's other ends (``client.peers``: the replica's own
    process is front 0), each ``Desk`` answered from a thread here. ``hand_over`` gives them Serve's listening
    socket."""

    def __init__(self, client: RemoteClient, config: ServerConfig, counts, replica: str, app_name: str,
                 desk: dict[str, Callable], log_level: str = "info", log: logging.Logger = logger):
        """``counts``: the replica's ``shared_counts``; ``desk``: what a front may ask, by name (``put``, ``all``,
        ``peers``); ``log``: where the replica's side logs."""
        ctx = mp.get_context("spawn")
        self.log = log
        self.desk = desk
        self.counts = counts  # alive while the fronts start: each maps it from this process
        self.draining = ctx.Event()
        self.fronts: list[tuple[mp.Process, object, object]] = []  # process, its desk's end, its socket's end
        self._closing = False
        self.alone = False
        """Serve's listening socket was not found: the fronts exited, the replica's own process serves."""
        for index, ends in enumerate(client.peers, 1):
            desk_end, their_desk = ctx.Pipe()
            sock_end, their_sock = ctx.Pipe()
            process = ctx.Process(target=front_main, name=f"chattts-velocity-replica-front-{index}", daemon=True,
                                  args=(ends, index, counts, config, replica, app_name, their_desk, their_sock,
                                        self.draining, log_level))
            process.start()
            for end in (ends, their_desk, their_sock):  # the front's now
                end.close()
            self.fronts.append((process, desk_end, sock_end))
            threading.Thread(target=self._answer, args=(desk_end,), name=f"replica-desk-{index}", daemon=True).start()

    def hand_over(self, find: Callable[[], int | None], timeout_s: float = LISTENER_WAIT_S,
                  stop_own: Callable[[int], object] = stop_serving) -> None:
        """From a thread: wait until ``find()`` gives the listening socket's descriptor, send it to every front,
        wait until they accept on it, then ``stop_own(fd)``: this process stops accepting on it. Not found in
        ``timeout_s``: the fronts are told so and exit; no front accepting within ``timeout_s``: this process
        goes on accepting too (either way the replica's own process serves)."""
        deadline = time.monotonic() + timeout_s
        fd = find()
        while fd is None and time.monotonic() < deadline and not self._closing:
            time.sleep(0.05)
            fd = find()
        self.alone = fd is None
        for process, _, sock_end in self.fronts:
            try:
                if fd is None:
                    sock_end.send(None)
                else:
                    sock_end.send(True)
                    send_handle(sock_end, fd, process.pid)
            except OSError as e:
                self.log.error("could not hand the listening socket to front process %d: %s", process.pid, e)
        if fd is None:
            if not self._closing:
                self.log.error("Serve's listening socket was not found within %g s: this replica's fronts exit, "
                               "its own process serves alone", timeout_s)
            return
        # until a front accepts, this process's server does: a connection never waits for nobody
        accepting = 0
        for _process, _, sock_end in self.fronts:
            try:
                if sock_end.poll(max(0.0, deadline - time.monotonic())) and sock_end.recv() == ACCEPTING:
                    accepting += 1
            except (EOFError, OSError):  # that front died: its health check says so
                pass
        if not accepting:
            self.log.error("no front process accepts on the replica's listening socket: its own process serves")
            return
        stopped = stop_own(fd)
        self.log.info("%d of %d front processes accept on the replica's listening socket (%d servers of this "
                      "process stopped)", accepting, len(self.fronts), stopped)

    def _answer(self, conn) -> None:
        """Answer one front's ``Desk`` until it goes away."""
        while True:
            try:
                op, args = conn.recv()
            except (EOFError, OSError):
                return
            try:
                reply = True, self.desk[op](*args)
            except Exception as e:  # noqa: BLE001 - the front gets the error, this thread goes on
                reply = False, repr(e)
            try:
                conn.send(reply)
            except OSError:
                return

    def drain(self) -> None:
        """Every front answers new speech requests 503 (the replica's state drains)."""
        self.draining.set()

    def health(self) -> str | None:
        """Why the replica cannot serve as it should (a front process exited), or None."""
        for process, _, _ in () if self.alone else self.fronts:
            if process.exitcode is not None:
                return f"HTTP front process {process.pid} exited with {process.exitcode}"
        return None

    def close(self, timeout_s: float) -> None:
        """Drain the fronts (``run.FRONT_SIGNAL``: the streams in flight finish, up to ``timeout_s``), then stop
        them."""
        self._closing = True
        for process, _, _ in self.fronts:
            order(process)
        deadline = time.monotonic() + timeout_s + 5
        for process, desk_end, sock_end in self.fronts:
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
            desk_end.close()
            sock_end.close()


def front_main(ends: FrontEnds, index: int, counts, config: ServerConfig, replica: str, app_name: str, desk_conn,
               sock_conn, draining, log_level: str) -> None:
    """A replica's front process ``index`` (``ReplicaFronts``): the app over its own ``ReplicaClient``, on
    Serve's listening socket once the replica sends it."""
    _die_with_parent(signal.SIGKILL)
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(levelname)s [replica {replica} front {index}] %(name)s: %(message)s")
    desk = Desk(desk_conn)
    client = ReplicaClient(ends, link=desk, replica=replica, front_count=len(counts) // 2, index=index,
                           voices_dir=config.voices_dir, beat_timeout_s=config.engine_timeout_s)
    client.wait_ready()
    app = build_app(client, config, _admission(config, counts, index), metric_labels={"replica": replica})
    app.add_middleware(ServeProbes, client=client, app_name=app_name)
    app.add_middleware(ReplicaHeader, replica=replica, front=index)
    state = app.state.speech

    def follow_drain() -> None:
        draining.wait()
        state.draining = True

    threading.Thread(target=follow_drain, name="replica-drain", daemon=True).start()
    freeze_long_lived()
    server = _server(app, config, None, None, log_level, follower=True)
    if not sock_conn.recv():  # the replica found no socket to share
        client.close()
        sys.exit(0)
    sock = socket.socket(fileno=recv_handle(sock_conn))

    def tell_accepting() -> None:  # once the server accepts, the replica's own may stop
        while not server.started and not server.should_exit:
            time.sleep(0.01)
        if server.started:
            sock_conn.send(ACCEPTING)

    threading.Thread(target=tell_accepting, name="replica-accepting", daemon=True).start()
    _run_front(server, client, sock)
