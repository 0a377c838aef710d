"""Run the speech server with uvicorn; SIGTERM (or Ctrl-C) drains: new speech requests get 503, the ones in
flight finish (up to ``shutdown_timeout_s``), then the process exits 0. A second signal exits at once.

``serve_split`` runs the engine in a process of its own, and with ``fronts`` > 1 that many HTTP front processes
over it, each with a listening socket of its own on the same port (``SO_REUSEPORT``: the kernel spreads new
connections over them). This process is the first front; it forwards its signals to the others and stops the
engine process once they all exited."""

from __future__ import annotations

import ctypes
import logging
import signal
import socket
import threading
import time

import uvicorn

from ..gc_freeze import freeze_long_lived
from .admission import forget_front, shared_counts
from .app import build_app
from .config import ServerConfig

logger = logging.getLogger(__name__)


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, timeout_s: float, on_signal=None, ignore_sigint: bool = False):
        """``on_signal(sig)`` is called with every signal this server handles (the first front forwards them
        to the others); ``ignore_sigint``: a front other than the first, whose signals come from the first
        (a Ctrl-C reaches the whole process group)."""
        super().__init__(config)
        self.state, self.timeout_s = state, timeout_s
        self.on_signal, self.ignore_sigint = on_signal, ignore_sigint

    def handle_exit(self, sig, frame) -> None:
        if self.ignore_sigint and sig == signal.SIGINT:
            return
        if self.on_signal is not None:
            self.on_signal(sig)
        if self.state.draining:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self.state.draining = True
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.state.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def warm_up(chat, streams: tuple[int, ...] = (1, 8, 37), tokens: int = 64) -> None:
    """Run short streams through the whole path (engine windows and CUDA graphs, the audio decoder's shapes,
    the allocator) so that the first clients do not pay for it: on an H100 the first request after start-up
    took 3.8 s to its first audio, the second 0.1 s. Each level starts its streams together, then again a
    few ms apart (prefills beside running decodes), with a speaker and a prompt that hits the prefix cache;
    37 streams arrive as more prompts than one prefill CUDA graph takes (16), so several prefill steps come in
    a row, and decode in larger window batches. With this warm-up and an empty Triton cache, a fresh H100 compiled no kernel while serving 1, 8 and then
    64 streams (`benchmarks/first_level.sh`, one run; before the prefill kernel stopped specialising on the
    batch, the 64 streams compiled two and two steps took 1.1-1.2 s)."""

    # as requests come: with a speaker, and a prompt long enough to share whole KV blocks (prefix-cache hits:
    # prefills of a few new tokens over cached ones)
    speaker = chat.sample_random_speaker()
    texts = ["Warming up the speech server with one sentence as long as a short request would be."]

    def one(seed: int, delay: float) -> None:
        time.sleep(delay)
        p = chat.InferCodeParams(spk_emb=speaker, max_new_token=tokens, min_new_token=tokens, manual_seed=seed,
                                 show_tqdm=False)
        for _ in chat._velocity.stream_joined(texts, p, use_decoder=True):
            pass

    # the stream windows' decode graphs, every batch bucket (a capture at first use would stall a round)
    chat.audio.use_graphs(chat._velocity.stream_config.window_lengths(), capture=True)
    for n in streams:
        for gap in (0.0, 0.003):
            threads = [threading.Thread(target=one, args=(i, i * gap)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    # Everything built so far (model, engine, block tables, libraries) lives as long as the server: keep it out
    # of the garbage collector's scans, so a full collection (which holds the GIL) walks only what requests
    # create. Measured after it (H100, `bash benchmarks/gpu_serve.sh`, 1/8/64/256 streams): 7 full
    # collections, 0.16 s in all (the `chattts_gc_pause_seconds` metric).
    freeze_long_lived()


def serve(chat, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          warmup: bool | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code. ``warmup`` (default: on CUDA) runs ``warm_up`` first."""
    if warmup if warmup is not None else chat.device.type == "cuda":
        warm_up(chat)
    app = build_app(chat, config)
    server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                            timeout_keep_alive=config.keep_alive_s),
                             app.state.speech, config.shutdown_timeout_s)
    try:
        server.run()
    finally:
        chat.unload()
    return 0


def serve_split(load: dict, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                warmup: bool | None = None, threads: int | None = None, fronts: int = 1) -> int:
    """``serve`` with the model and engine in a process of their own (``split``): it loads ``Chat.load(**load)``
    (and warms up, by default on CUDA), this process serves HTTP, with ``fronts - 1`` more front processes
    beside it on the same port. SIGTERM drains as in ``serve`` (every front), then stops the engine process.
    Returns the exit code."""
    import multiprocessing as mp

    from .split import EngineProcess

    if fronts > 1 and not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("--fronts needs SO_REUSEPORT (Linux), which this system's sockets lack")
    sock = _listen(host, port, alone=True) if fronts > 1 else None
    port = sock.getsockname()[1] if sock is not None else port
    engine = EngineProcess.start(load, config, warmup=warmup, log_level=log_level, threads=threads, fronts=fronts)
    counts = shared_counts(fronts) if fronts > 1 else None
    ctx = mp.get_context("spawn")
    others = [ctx.Process(target=_front_main, name=f"chattts-velocity-front-{i}", daemon=True,
                          args=(ends, i, counts, config, host, port, log_level)) for i, ends in enumerate(engine.fronts, 1)]
    for i, process in enumerate(others, 1):
        process.start()
        for end in engine.fronts[i - 1]:  # the front's now: when it exits, the engine process sees its pipes close
            end.close()
    server = None
    try:
        info = engine.wait_ready()
        app = build_app(engine, config, shared_counts=counts)
        # the front's long-lived objects (torch, the tokenizer, the app) out of the collector's scans: a full
        # collection walking them paused the front's event loop, and every response's headers with it
        freeze_long_lived()

        def forward(sig) -> None:  # SIGTERM to every other front: the first drains, a second stops now
            for process in others:
                if process.is_alive():
                    process.terminate()

        server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                timeout_keep_alive=config.keep_alive_s),
                                 app.state.speech, config.shutdown_timeout_s, on_signal=forward)
        for i, process in enumerate(others, 1):
            threading.Thread(target=_watch_front, args=(process, i, counts, server), daemon=True).start()
        extra = f"; {fronts} HTTP front processes" if fronts > 1 else ""
        print(f"serving on http://{host}:{port} (OpenAI /v1/audio/speech; engine process {engine.process.pid} on "
              f"{info.get('device')}{extra})", flush=True)
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        if others and (server is None or not server.state.draining):  # not stopped by a signal: stop them
            for process in others:
                if process.is_alive():
                    process.terminate()
        for process in others:  # they drain as this one did
            process.join(config.shutdown_timeout_s + 10)
            if process.is_alive():
                process.kill()
                process.join(5)
        engine.close()
    return 0


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


def _watch_front(process, index: int, counts, server: _DrainingServer) -> None:
    """Log a front process that exits while the server is not stopping, and zero its admission counts (the
    engine process cancels its requests when its pipes close)."""
    process.join()
    if not server.state.draining and not server.should_exit:
        logger.error("HTTP front process %d exited with %s; the other fronts go on serving", index, process.exitcode)
        forget_front(counts, index)


def _front_main(ends: tuple, index: int, counts, config: ServerConfig, host: str, port: int, log_level: str) -> None:
    """A front process other than the first (``serve_split`` with ``fronts`` > 1): the app over its own handle
    on the engine process, on its own socket of the same port. Its signals come from the first front."""
    from .split import EngineProcess

    _die_with_parent()
    logging.basicConfig(level=log_level.upper(), format=f"%(levelname)s [front {index}] %(name)s: %(message)s")
    engine = EngineProcess(*ends, index=index)
    engine.wait_ready()
    app = build_app(engine, config, shared_counts=counts)
    freeze_long_lived()
    server = _DrainingServer(uvicorn.Config(app, log_level=log_level, timeout_keep_alive=config.keep_alive_s),
                             app.state.speech, config.shutdown_timeout_s, ignore_sigint=True)
    server.run(sockets=[_listen(host, port)])


def _die_with_parent() -> None:
    """Have the kernel send this process SIGTERM (a drain) if the process that started it dies (Linux); exit
    at once if it died already, before this took effect."""
    import multiprocessing as mp
    import os
    import sys

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing watches the parent
        return
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # re-parented: it is gone
        sys.exit(0)
