"""What a busy server does to a request's preparation: ``server.app._prepare`` (sentences, voice, prompt
checks, the engine sequence; about half a millisecond of work) timed alone and beside a thread that runs
Python without pause, as the engine thread does between its GPU waits. Every torch call lets go of the GIL
and must take it back, which beside a busy thread can take a switch interval (5 ms) each.

    python benchmarks/prepare_gil.py            # tiny random checkpoint, CPU
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time

import torch


def main() -> None:
    sys.path.insert(0, "tests")
    from upstream_checkpoint import write_upstream_checkpoint

    from chattts_velocity import Chat
    from chattts_velocity.bench.serve import TEXT
    from chattts_velocity.server import ServerConfig
    from chattts_velocity.server import app as server_app
    from chattts_velocity.server.schema import SpeechRequest

    torch.set_num_threads(1)
    chat = Chat()
    chat.load(source="custom", custom_path=write_upstream_checkpoint(tempfile.mkdtemp(), seed=0), device="cpu")
    state = server_app._State(chat, ServerConfig())
    body = SpeechRequest(model="tts-1", voice="alloy", input=TEXT, response_format="pcm", seed=1)

    def median_ms(n: int = 60) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            server_app._prepare(state, body).cancel()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    print(f"alone: {median_ms():.3f} ms")
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        print(f"beside a busy Python thread: {median_ms():.3f} ms")
    finally:
        stop.set()
        thread.join()
    chat.unload()


if __name__ == "__main__":
    main()
