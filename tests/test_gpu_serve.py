"""The speech server on a GPU under the load that once hung one: ``--fronts 4``, one stream then 64 closed-loop
streams of 500-token requests (the README's serving command without its 256 level). A stream window's decode
and the engine's window, each a CUDA graph on its own stream, never finished while their graphs shared one
cuBLAS workspace (docs/perf/serve.md; ``audio.graphs.DecodeGraphs.capture_stream``). The hang came mostly with
the wav decode's fused kernels (the default), so the load runs with them and with the modules' torch ops.
Run on the device machine: ``python -m pytest -m gpu tests/test_gpu_serve.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from server_helpers import ServerProcess, engine_processes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SERVER = ("--fronts", "4", "--max-concurrent", "256", "--max-queue", "512", "--max-new-token", "500",
          "--min-new-token", "500")
BENCH_LIMIT_S = 120
"""Far more than the load takes on an H100 (a few seconds): past it the server counts as hung."""


def serve_ramp(tmp_path, env: dict, device: str = "cuda", model_dir: str | None = None,
               server_args: tuple[str, ...] = SERVER, streams: tuple[int, ...] = (1, 64)) -> list[dict]:
    """A fresh server (``env`` on top of this one's), ``bench serve --streams 1 64 --requests-per-stream 2``
    against it: the bench's rows. Raises ``subprocess.TimeoutExpired`` if the bench outlasts ``BENCH_LIMIT_S``.
    Every process of the server is gone afterwards (a hung engine process does not leave on SIGTERM)."""
    server = ServerProcess(model_dir, *server_args, api_key=None, device=device, env=env, ready_timeout=600,
                           log_path=str(tmp_path / "server.log"))
    children = engine_processes(server.proc.pid)
    try:
        out = tmp_path / "bench.json"
        subprocess.run([sys.executable, "-m", "chattts_velocity.cli", "bench", "serve", "--url", server.url,
                        "--streams", *map(str, streams), "--requests-per-stream", "2", "--json", str(out)],
                       timeout=BENCH_LIMIT_S, check=True, capture_output=True)
        return json.loads(out.read_text())["rows"]
    finally:
        server.stop(timeout=20)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def check_served(rows: list[dict], streams: tuple[int, ...] = (1, 64)) -> None:
    assert [row["streams"] for row in rows] == list(streams)
    for row in rows:
        assert row["failures"] == 0, row["errors"]
        assert row["requests"] == 2 * row["streams"]
        assert row["rtf_total"] > 0


def test_gpu_server_serves_one_then_64_streams_by_default(tmp_path) -> None:
    env = {"CHATTTS_VELOCITY_FUSED_DECODE": ""}  # the default (unset): the fused decode
    check_served(serve_ramp(tmp_path, env))


def test_gpu_server_with_the_decodes_torch_ops(tmp_path) -> None:
    check_served(serve_ramp(tmp_path, {"CHATTTS_VELOCITY_FUSED_DECODE": "0"}))
