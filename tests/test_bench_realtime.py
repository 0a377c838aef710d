"""``chattts-velocity bench serve --realtime`` against a live server over a tiny checkpoint (every sentence held to
the same length, so a context is still speaking when it is interrupted): every figure of a level is measured
(first audio, segments, usage, barge-ins, the KV probe), a level split over client processes counts every context
once, and a missing server or a misplaced ``--realtime`` is a clean error. Speed targets are judged on a GPU."""

from __future__ import annotations

import json
import socket
import sys

import pytest
from server_helpers import API_KEY, ServerProcess

from chattts_velocity.bench.realtime import RealtimeBenchConfig, run_and_report
from chattts_velocity.bench.realtime_client import ContextRun
from chattts_velocity.cli import main

TOKENS = 64
"""Audio tokens of every sentence (--min-new-token = --max-new-token): several audio deltas each."""


@pytest.fixture(scope="module")
def server(upstream_ckpt):
    srv = ServerProcess(upstream_ckpt, "--max-new-token", str(TOKENS), "--min-new-token", str(TOKENS))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def report(server, tmp_path_factory) -> tuple[dict, str]:
    path = tmp_path_factory.mktemp("realtime") / "bench_realtime.json"
    cfg = RealtimeBenchConfig(url=server.url, streams=(1, 4), words_per_s=40, barge_in=0.25, sentences=2,
                              api_key=API_KEY, json_path=str(path))
    return run_and_report(cfg), str(path)


def test_every_context_is_heard_and_timed(report):
    rows = report[0]["rows"]
    assert [(r["streams"], r["contexts"], r["failures"]) for r in rows] == [(1, 1, 0), (4, 4, 0)], rows
    for r in rows:
        assert 0 < r["first_audio_p50_ms"] <= r["first_audio_p95_ms"] <= r["first_audio_p99_ms"]
        assert r["audio_s_p50"] > 0 and r["audio_s_per_s"] > 0 and r["client_processes"] == 1
        assert r["usage_mismatches"] == 0  # the audio received is what audio.done says was sent
        assert 0 <= r["underruns"] <= r["contexts"]
    # the three contexts of the 4-socket level that were not interrupted: each sentence's segment
    assert rows[1]["segments"] >= 2 * 3


def test_barge_ins_are_cancelled_with_no_audio_after(report):
    for r in report[0]["rows"]:
        assert r["barge_ins"] == 1 and r["cancelled"] == 1  # ceil(0.25 * n)
        assert r["cancel_to_cancelled_p50_ms"] > 0 and r["cancel_to_last_audio_p50_ms"] >= 0
        assert r["audio_after_cancelled"] == 0 and r["kv_probe_audio_after_cancelled"] == 0


def test_kv_probe_sees_blocks_held_then_freed(report):
    for r in report[0]["rows"]:
        assert r["kv_probe_contexts"] == 1 and "kv_probe_error" not in r
        assert r["kv_blocks_held"] > r["kv_blocks_before_probe"] == 0  # the cancel had blocks to free
        assert 0 <= r["kv_free_after_ms"] < r["kv_free_ms"]
        assert r["kv_probe_cancelled_max_ms"] > 0
        assert r["kv_blocks_before"] == r["kv_blocks_after"] == 0


def test_report_is_written_with_its_definitions(report):
    data, path = report
    with open(path) as f:
        assert json.load(f) == json.loads(json.dumps(data))
    assert {"first_audio_*_ms", "underruns", "kv_free_ms"} <= data["definitions"].keys()
    assert data["config"]["streams"] == (1, 4) and "api_key" not in data["config"]


def test_a_level_split_over_client_processes_counts_every_context_once(server):
    cfg = RealtimeBenchConfig(url=server.url, streams=(2,), words_per_s=40, barge_in=0.5, sentences=1,
                              api_key=API_KEY, json_path=None, streams_per_process=1)
    (row,) = run_and_report(cfg)["rows"]
    assert row["client_processes"] == 2 and row["contexts"] == 2 and row["failures"] == 0, row
    assert row["barge_ins"] == 1 and row["first_audio_p50_ms"] > 0 and row["audio_after_cancelled"] == 0


def test_playback_figures_of_one_context():
    """Playback from the first audio on: the second delta is late (underrun); of the audio after the cancel the
    last one counts, and the audio after context.cancelled is counted apart."""
    run = ContextRun(barge=True, first_end=9.9, arrivals=[10.0, 10.5, 11.0], samples=[2400, 2400, 2400])
    run.cancel_sent, run.cancelled, run.after_cancelled = 10.8, 11.2, 1
    r = run.result()
    assert r["ok"] and r["underrun"] and r["first_audio_s"] == pytest.approx(0.1)
    assert r["last_audio_s"] == pytest.approx(0.2) and r["cancelled_s"] == pytest.approx(0.4)
    assert r["after_cancelled"] == 1 and r["audio_s"] == pytest.approx(0.3)
    smooth = ContextRun(barge=False, first_end=0.0, arrivals=[0.1, 0.15], samples=[2400, 2400], usage={})
    assert smooth.result()["underrun"] is False and smooth.result()["last_audio_s"] is None


def test_no_server_is_a_clean_error(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "r.json"
    assert main(["bench", "serve", "--realtime", "--url", f"http://127.0.0.1:{port}", "--streams", "1",
                 "--json", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: no speech server answers at http://127.0.0.1:{port}")
    assert not path.exists()


@pytest.mark.parametrize("args, message", [
    (["bench", "--realtime"], "--realtime drives a running server"),
    (["bench", "serve", "--realtime", "--barge-in", "2"], "--barge-in must be a fraction from 0 to 1"),
    (["bench", "serve", "--realtime", "--words-per-s", "0"], "--words-per-s must be > 0"),
    (["bench", "serve", "--realtime", "--url", "ftp://x"], "--url must be a server address"),
])
def test_bad_arguments_exit_2(args, message, capsys):
    assert main(args) == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_without_websockets_the_run_fails_before_it_starts(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "websockets.asyncio.client", None)  # makes the import raise ImportError
    assert main(["bench", "serve", "--realtime", "--streams", "1"]) == 2
    assert "error: bench serve --realtime needs websockets >= 13" in capsys.readouterr().err
