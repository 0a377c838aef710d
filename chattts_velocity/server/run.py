"""Run the speech server with uvicorn; SIGTERM (or Ctrl-C) drains: new speech requests get 503, the ones in
flight finish (up to ``shutdown_timeout_s``), then the process exits 0. A second signal exits at once."""

from __future__ import annotations

import threading
import time

import uvicorn

from ..gc_freeze import freeze_long_lived
from .app import build_app
from .config import ServerConfig


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, timeout_s: float):
        super().__init__(config)
        self.state, self.timeout_s = state, timeout_s

    def handle_exit(self, sig, frame) -> None:
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
                warmup: bool | None = None, threads: int | None = None) -> int:
    """``serve`` with the model and engine in a process of their own (``split``): it loads ``Chat.load(**load)``
    (and warms up, by default on CUDA), this process serves HTTP. SIGTERM drains as in ``serve``, then stops the
    engine process. Returns the exit code."""
    from ..gc_freeze import freeze_long_lived
    from .split import EngineProcess

    engine = EngineProcess.start(load, config, warmup=warmup, log_level=log_level, threads=threads)
    try:
        info = engine.wait_ready()
        app = build_app(engine, config)
        # the front's long-lived objects (torch, the tokenizer, the app) out of the collector's scans: a full
        # collection walking them paused the front's event loop, and every response's headers with it
        freeze_long_lived()
        server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                timeout_keep_alive=config.keep_alive_s),
                                 app.state.speech, config.shutdown_timeout_s)
        print(f"serving on http://{host}:{port} (OpenAI /v1/audio/speech; engine process {engine.process.pid} on "
              f"{info.get('device')})", flush=True)
        server.run()
    finally:
        engine.close()
    return 0
