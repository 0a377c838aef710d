"""Launching the speech server: the topology is chosen here, once (``launch``), and the app over the chosen
``EngineClient`` never learns which. SIGTERM (or Ctrl-C) drains: new speech requests get 503, the ones in flight
finish (up to ``shutdown_timeout_s``), then the process exits 0. A second signal exits at once.

- One process (``serve_local``): the model, its engine thread and the HTTP front share a process and its GIL.
- An engine process with N HTTP fronts (``serve_fronts``; ``--engine-process`` is its one-front case, ``--fronts
  N`` more): each front is a process with a listening socket of its own on the same port (``SO_REUSEPORT``: the
  kernel spreads new connections over them), all admitting against the same limits. This process is the first
  front; it forwards its signals to the others, starts a new front in place of one that dies (``Respawner``:
  a front that keeps dying stops the server with exit 1 instead), and stops the engine process once they all
  exited. A dead engine process stops the server with exit 1 (``engine_lost``), for its supervisor.
- Ray Serve replicas (``scale.run``), each a whole one-process server."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI

from ..gc_freeze import freeze_long_lived
from ..serving.client import EngineGoneError
from ..serving.engine_process.host import EngineSettings
from ..serving.engine_process.messages import FrontEnds
from ..serving.engine_process.remote import RemoteClient
from ..serving.load import load_chat
from ..serving.local import LocalClient
from .admission import Admission, Backlog, forget_front, shared_counts
from .app import build_app
from .connections import uvicorn_protocol
from .settings import DIRECT_INGRESS_ENV, HAPROXY_ENV, HAPROXY_RETRY_ENV, ServerConfig, ServeSettings

logger = logging.getLogger(__name__)


def launch(settings: ServeSettings) -> int:
    """Serve as ``settings`` say until a signal stops it; returns the exit code."""
    if settings.scale is not None:
        if settings.scale.ingress == "haproxy":  # read when Ray Serve is imported, here and by the Ray processes
            os.environ.update({HAPROXY_ENV: "1", DIRECT_INGRESS_ENV: "1"})  # started from here
            # a request whose replica closed the connection without an answer (it died) goes to another
            os.environ.setdefault(HAPROXY_RETRY_ENV, "conn-failure empty-response")
        try:
            from .scale import run  # Ray: an optional dependency
        except ImportError as e:
            raise ValueError(f"replicas need Ray Serve: pip install -e \".[scale]\" from a clone, or "
                             f"\"chattts-velocity[scale]\" from an index ({e})") from None
        return run(settings)
    if settings.engine_process:
        return serve_fronts(settings)
    return serve_local(settings)


FRONT_SIGNAL = signal.SIGUSR1
"""What the first front sends each other front for every signal it handles (``order``): the first drains that
front, a second stops it at once. The other fronts ignore SIGINT and SIGTERM, which a Ctrl-C, a ``kill`` of the
process group or a service manager's stop (systemd signals every process of a service) send them too: with
both the group's signal and the forwarded one, a front would take the second for "stop now" and cut its
streams off instead of draining them."""


def order(process) -> None:
    """Send a front process (other than the first) ``FRONT_SIGNAL``, if it is still running."""
    if process.is_alive():
        try:
            os.kill(process.pid, FRONT_SIGNAL)
        except ProcessLookupError:  # it exited meanwhile
            pass


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, timeout_s: float, on_signal=None, follower: bool = False):
        """``on_signal(sig)`` is called with every signal this server handles (the first front forwards them
        to the others); ``follower``: a front other than the first, whose signals come from the first
        (``FRONT_SIGNAL``; SIGINT and SIGTERM are ignored)."""
        super().__init__(config)
        self.state, self.timeout_s = state, timeout_s
        self.on_signal, self.follower = on_signal, follower
        if follower:
            signal.signal(FRONT_SIGNAL, self.handle_exit)
        self.exit_code = 0
        """1 once the engine is gone (``engine_lost``): the process exits non-zero, for its supervisor."""
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.follower and sig in (signal.SIGINT, signal.SIGTERM):
            return
        if self.on_signal is not None:
            self.on_signal(sig)
        if self.state.draining:  # a second signal: stop now, whatever is still streaming
            self._cut_off()
            return
        self.state.draining = True
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.state.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state.in_flight:  # time is up: no more waiting for bodies (a client that stopped reading)
            logger.warning("shutdown timeout: %d responses still streaming are cut off", self.state.in_flight)
            self._call(self._cut_off)
        self.should_exit = True
        # a connection whose response ended but whose client reads nothing keeps unsent bytes, and uvicorn's
        # shutdown would wait for it to close: once the timeout is over, cut off whatever is still open
        time.sleep(max(0.0, deadline - time.monotonic()) + 1.0)
        self._call(self._cut_off)

    def _call(self, fn) -> None:
        """Run ``fn`` on the event loop, unless the server stopped already (its loop closed)."""
        try:
            self._loop.call_soon_threadsafe(fn)
        except (AttributeError, RuntimeError):
            pass

    def fail(self, why: str) -> None:
        """Part of the server died (an HTTP front process): drain as on SIGTERM, every front with it, then exit
        1, for a supervisor to restart the whole server (a front cannot be replaced: the engine process's pipes
        are made once, at start)."""
        if self.state.draining:
            return
        logger.error("%s: the server drains and stops (exit 1)", why)
        self.exit_code = 1
        self.handle_exit(signal.SIGTERM, None)

    def engine_lost(self, why: str) -> None:
        """The engine process died: nothing can be generated any more. Stop now with exit code 1 (from any
        thread) rather than answer 503 for ever: a supervisor (systemd, Docker, Kubernetes) restarts the server."""
        logger.error("%s: the server stops (exit 1)", why)
        self.exit_code = 1
        self.state.draining = True
        if self._loop is None:  # not serving yet: it stops as soon as it starts
            self.force_exit = self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._cut_off)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def _cut_off(self) -> None:
        """Stop now (on the event loop): drop every connection still open, so that neither uvicorn's shutdown
        nor the listening socket's close waits for a client that stopped reading."""
        self.force_exit = self.should_exit = True
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()


def serve_local(settings: ServeSettings) -> int:
    """The model, its engine and the HTTP front in this process (``load_chat``: warmed up on CUDA)."""
    config = settings.server
    chat = load_chat(settings.load, audio_round_ms=config.audio_round_ms, threads=settings.threads,
                     audio_thread=config.audio_thread)
    client = LocalClient(chat, config.voices_dir, owns_chat=True)
    try:
        admission = _admission(config, None, 0)
        chat.engine.set_backlog(lambda: admission.backlogged)  # a full server's windows run whole
        app = build_app(client, config, admission)
        print(f"serving on http://{settings.host}:{settings.port} (OpenAI /v1/audio/speech)", flush=True)
        _server(app, config, settings.host, settings.port, settings.log_level).run()
    finally:
        client.close()
    return 0


def serve_fronts(settings: ServeSettings) -> int:
    """The model and engine in a process of their own (``RemoteClient.start_engine``), this process the first
    of ``settings.fronts`` HTTP fronts over it, the others started here on the same port. SIGTERM drains every
    front, then stops the engine process."""
    config, fronts, host = settings.server, settings.fronts, settings.host
    if fronts > 1 and not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("--fronts needs SO_REUSEPORT (Linux), which this system's sockets lack")
    sock = _listen(host, settings.port, alone=True) if fronts > 1 else None
    port = sock.getsockname()[1] if sock is not None else settings.port
    engine = EngineSettings(voices_dir=config.voices_dir, audio_round_ms=config.audio_round_ms,
                            audio_thread=config.audio_thread, threads=settings.threads, log_level=settings.log_level)
    # every front's admission counts in shared memory, where the engine process sees a full server's queue too
    counts = shared_counts(fronts)
    client = RemoteClient.start_engine(settings.load, engine, fronts=fronts,
                                       backlog=Backlog(counts, config.max_concurrent),
                                       beat_timeout_s=config.engine_timeout_s)
    ctx = mp.get_context("spawn")
    front_args = counts, config, host, port, settings.log_level
    others = [_start_front(ctx, ends, i, front_args) for i, ends in enumerate(client.peers, 1)]
    server = None
    try:
        info = client.wait_ready()
        app = build_app(client, config, _admission(config, counts, 0))
        # the front's long-lived objects (torch, the tokenizer, the app) out of the collector's scans: a full
        # collection walking them pauses the front's event loop, and every response's headers with it
        freeze_long_lived()

        def forward(sig) -> None:  # to every other front: the first drains, a second stops now
            for process in others:
                order(process)

        server = _server(app, config, host, port, settings.log_level, on_signal=forward)
        client.on_lost = server.engine_lost
        respawner = Respawner(server, client, others, lambda ends, i: _start_front(ctx, ends, i, front_args), counts)
        for i in range(1, fronts):
            threading.Thread(target=respawner.watch, args=(i,), name=f"chattts-velocity-watch-{i}", daemon=True).start()
        extra = f"; {fronts} HTTP front processes" if fronts > 1 else ""
        print(f"serving on http://{host}:{port} (OpenAI /v1/audio/speech; engine process {client.process.pid} on "
              f"{info.device}{extra})", flush=True)
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        _stop_fronts(others, config, stopped_by_signal=server is not None and server.state.draining)
        client.close()
    return server.exit_code


def _start_front(ctx, ends: FrontEnds, index: int, args: tuple) -> mp.Process:
    process = ctx.Process(target=_front_main, name=f"chattts-velocity-front-{index}", daemon=True,
                          args=(ends, index, *args))
    process.start()
    ends.close()  # the front's now: when it exits, the engine process sees its pipes close
    return process


class Respawner:
    """Watches the other fronts' processes (``others[i - 1]`` is front ``i``) from the first front: one that
    exits while the server is not stopping has its admission counts zeroed (the engine process cancels its
    requests when its pipes close) and is started anew over new pipes (``RemoteClient.add_front``), unless it
    died ``MAX_DEATHS`` times within ``WINDOW_S``: then the server drains and exits 1 (``fail``), for its
    supervisor, rather than restart a front that cannot live."""

    MAX_DEATHS = 3
    WINDOW_S = 60.0

    def __init__(self, server: _DrainingServer, client: RemoteClient, others: list, start, counts):
        """``start(ends, index)``: a new front process over ``ends``."""
        self.server, self.client, self.others, self.start, self.counts = server, client, others, start, counts
        self._deaths: dict[int, list[float]] = {}

    def watch(self, index: int) -> None:
        """Until the server stops: wait for front ``index``'s process to exit, then replace it."""
        while True:
            process = self.others[index - 1]
            process.join()
            if self.server.state.draining or self.server.should_exit:
                return
            forget_front(self.counts, index)
            why = f"HTTP front process {index} (pid {process.pid}) exited with {process.exitcode}"
            now = time.monotonic()
            deaths = self._deaths[index] = [t for t in self._deaths.get(index, []) if now - t < self.WINDOW_S] + [now]
            if len(deaths) >= self.MAX_DEATHS:
                self.server.fail(f"{why}, its {len(deaths)}th exit within {self.WINDOW_S:g} s")
                return
            try:
                self.others[index - 1] = self.start(self.client.add_front(index), index)
            except (EngineGoneError, OSError) as e:
                self.server.fail(f"{why}, and a new one could not start ({e})")
                return
            logger.error("%s: started a new one (pid %d)", why, self.others[index - 1].pid)


def _stop_fronts(others: list, config: ServerConfig, stopped_by_signal: bool) -> None:
    """Wait for the other fronts to drain as this one did (stopping them first if no signal did)."""
    if not stopped_by_signal:
        for process in others:
            order(process)
    for process in others:
        process.join(config.shutdown_timeout_s + 10)
        if process.is_alive():
            process.kill()
            process.join(5)


def _admission(config: ServerConfig, counts, index: int) -> Admission:
    """Front ``index``'s admission: over ``shared_counts`` of every front, or (``counts`` None) its own."""
    return Admission(config.max_concurrent, config.max_queue, counts, index if counts is not None else 0)


def _server(app: FastAPI, config: ServerConfig, host: str | None, port: int | None, log_level: str,
            on_signal=None, follower: bool = False) -> _DrainingServer:
    kw = {} if host is None else dict(host=host, port=port)
    uvi = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=config.keep_alive_s,
                         http=uvicorn_protocol(config), **kw)
    return _DrainingServer(uvi, app.state.speech, config.shutdown_timeout_s, on_signal, follower)


def _listen(host: str, port: int, alone: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port`` that other processes may bind as well (``SO_REUSEPORT``).
    ``alone`` (the first front): the port must be free, else ``ValueError`` (another server's ``SO_REUSEPORT``
    sockets would let this one bind too, and the kernel would spread connections over both servers)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if alone:
        with socket.socket(family, socket.SOCK_STREAM) as probe:  # no SO_REUSEPORT: fails if anything is bound
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
            port = probe.getsockname()[1]  # port 0: the one the system chose
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def _front_main(ends: FrontEnds, index: int, counts, config: ServerConfig, host: str, port: int,
                log_level: str) -> None:
    """A front process other than the first (``serve_fronts``): the app over its own ``RemoteClient``, on its
    own socket of the same port. Its signals come from the first front."""
    _die_with_parent()
    logging.basicConfig(level=log_level.upper(), format=f"%(levelname)s [front {index}] %(name)s: %(message)s")
    client = RemoteClient(ends, index=index, voices_dir=config.voices_dir, beat_timeout_s=config.engine_timeout_s)
    client.wait_ready()
    app = build_app(client, config, _admission(config, counts, index))
    freeze_long_lived()
    server = _server(app, config, None, None, log_level, follower=True)
    _run_front(server, client, _listen(host, port))


def _run_front(server: _DrainingServer, client: RemoteClient, sock: socket.socket) -> None:
    """A front process's server on ``sock`` until it stops; then leave the engine process and exit with the
    server's code (1 once the engine is gone)."""
    client.on_lost = server.engine_lost
    try:
        server.run(sockets=[sock])
    finally:
        client.close()
    sys.exit(server.exit_code)


def _die_with_parent(sig: int = FRONT_SIGNAL) -> None:
    """Have the kernel send this process ``sig`` (``FRONT_SIGNAL``: a drain) if the process that started it dies (Linux);
    exit at once if it died already, before this took effect."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing watches the parent
        return
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # re-parented: it is gone
        sys.exit(0)
