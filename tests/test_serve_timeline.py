"""``benchmarks/serve_timeline.py`` on the tiny model on the CPU: its open-loop mode runs ``bench serve --rates``
against the instrumented in-process server and reports the engine thread's time and the requests' phases (a
run of the script, so its wrappers around the engine keep up with the engine's signatures); its split server
(``--split``) keeps serving through its front process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_timeline.py"


def test_the_open_loop_timeline_reports_the_engine_and_the_requests(tmp_path):
    out = tmp_path / "timeline.json"
    subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--http", "--rates", "4", "--duration", "2",
                    "--streams", "4", "--tokens", "32", "--min-new-token", "32", "--json", str(out)],
                   check=True, capture_output=True, timeout=600)
    (row,) = json.loads(out.read_text())
    assert row["rate"] == 4 and row["arrivals"] > 0 and row["failed"] == 0
    assert row["engine_steps"] > 0 and 0 < row["of_which_windows_s"] <= row["engine_step_s"]
    phases = row["request_phases"]
    for name in ("engine: queued -> first token", "engine: first token -> first audio",
                 "first token -> first audio: in windows"):
        assert phases[name]["n"] >= row["arrivals"], name  # (and the bench's warm-up requests)
    assert row["first_audio_p50_ms"] > 0


def test_the_split_server_keeps_its_front_hearing_the_engine(monkeypatch):
    """``--split``: the engine behind an ``EngineHost`` here, the HTTP front in a process of its own, which
    takes an engine it has not heard from for ``engine_timeout_s`` for hung (503): the host beats, so past that
    time the front is healthy and serves."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # (the spawned front imports the script's module too)
    import httpx
    import serve_timeline

    from chattts_velocity.bench.stream import StreamBenchConfig, load_bench_chat
    from chattts_velocity.server import ServerConfig

    chat = load_bench_chat(StreamBenchConfig(size="tiny"), 4)
    url = serve_timeline.start_split_server(chat, ServerConfig(max_new_token=16, engine_timeout_s=1.0))
    time.sleep(3.0)  # three engine timeouts
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    r = httpx.post(url + "/v1/audio/speech", json={"model": "tts-1", "input": "hello there", "voice": "alloy",
                                                   "response_format": "pcm"}, timeout=120)
    assert r.status_code == 200 and len(r.content) > 0
