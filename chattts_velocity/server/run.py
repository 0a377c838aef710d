"""Run the speech server with uvicorn; SIGTERM (or Ctrl-C) drains: new speech requests get 503, the ones in
flight finish (up to ``shutdown_timeout_s``), then the process exits 0. A second signal exits at once."""

from __future__ import annotations

import threading
import time

import uvicorn

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


def serve(chat, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    app = build_app(chat, config)
    server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level),
                             app.state.speech, config.shutdown_timeout_s)
    try:
        server.run()
    finally:
        chat.unload()
    return 0
