"""``chattts-velocity bench stream``: underruns and the start delay (``StreamRecord``, which ``bench serve --rates``
uses too), the first-audio percentiles, and a run on the tiny checkpoint."""

from __future__ import annotations

import argparse

import pytest

from chattts_velocity.audio.stream import StreamConfig
from chattts_velocity.bench import cli as bench_cli
from chattts_velocity.bench.stream import (
    StreamBenchConfig,
    StreamRecord,
    _median,
    format_table,
    load_bench_chat,
    run_stream_bench,
    summarize,
)

RATE = 24000


def test_start_delay_is_how_far_the_latest_chunk_is_behind_the_audio_before_it():
    on_time = StreamRecord(arrivals=[0.1, 0.2, 0.3], samples=[RATE // 5, RATE // 5, RATE])
    assert on_time.start_delay() == 0.0 and not on_time.underrun()
    late = StreamRecord(arrivals=[0.1, 0.35, 0.4], samples=[RATE // 10, RATE, RATE])  # 0.1 s, then 0.25 s later
    assert late.start_delay() == pytest.approx(0.15) and late.underrun()
    jitter = StreamRecord(arrivals=[0.0, 0.1005], samples=[RATE // 10, RATE])  # within the 1 ms tolerance
    assert jitter.underrun() is False and jitter.start_delay() == pytest.approx(0.0005)
    assert StreamRecord().underrun() and StreamRecord().start_delay() == float("inf")
    assert on_time.stall_chunk() is None and jitter.stall_chunk() is None and late.stall_chunk() == 1
    later = StreamRecord(arrivals=[0.1, 0.15, 0.5, 0.6], samples=[RATE // 10, RATE // 10, RATE // 10, RATE])
    assert later.stall_chunk() == 2 and later.start_delay() == pytest.approx(0.2)


def test_summary_has_first_audio_and_start_delay_percentiles():
    records = [StreamRecord(arrivals=[0.01 * (i + 1), 0.5], samples=[RATE // 10, RATE], end=1.0) for i in range(20)]
    row = summarize(records)
    assert row["underruns"] == 20 and row["streams"] == 20
    assert row["ttfa_p50_ms"] == pytest.approx(105.0) and row["ttfa_p95_ms"] == pytest.approx(190.5)
    assert row["start_delay_p50_ms"] == pytest.approx(295.0) and row["start_delay_p95_ms"] > row["start_delay_p50_ms"]
    assert row["stalls_at_chunk"] == {"1": 20}
    merged = _median([row, summarize(records[:5] + [StreamRecord(arrivals=[0.1], samples=[RATE], end=1.0)])])
    assert merged["stalls_at_chunk"] == {"1": 25} and merged["underruns"] == 20 and merged["repeats"] == 2


def test_a_run_on_the_tiny_checkpoint_reports_each_level(tmp_path):
    cfg = StreamBenchConfig(streams=(1, 3), tokens=60, size="tiny", device="cpu", repeats=1,
                            reference_max_streams=0, json_path=None, window_stops=(16, 24))
    report = run_stream_bench(cfg)
    assert [row["streams"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["path"] == "velocity" and 0 <= row["start_delay_p50_ms"] <= row["start_delay_p95_ms"]
        assert row["ttfa_p50_ms"] <= row["ttfa_p95_ms"] <= row["ttfa_p99_ms"] and row["audio_s_per_s"] > 0
    assert "underruns" in report["definitions"] and "start delay p50 / p95 ms" in format_table(report)
    assert report["window_stops"] == [16, 24] and report["window_stop_budget_ms"] == 50.0  # what the engine ran with
    assert report["window_budget_ms"] == 300.0


@pytest.mark.parametrize(("argv", "repeats"), [([], 2), (["--repeats", "1"], 1), (["--repeats", "3"], 3)])
def test_bench_stream_runs_as_many_times_as_asked_two_by_default(monkeypatch, argv, repeats):
    ran = []
    monkeypatch.setattr(bench_cli, "run_stream", ran.append)
    parser = argparse.ArgumentParser()
    bench_cli.add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "stream", "--size", "tiny", *argv])
    assert args.func(args) == 0
    assert [cfg.repeats for cfg in ran] == [repeats]


def test_bench_stream_streams_in_the_chunks_asked(monkeypatch):
    ran = []
    monkeypatch.setattr(bench_cli, "run_stream", ran.append)
    parser = argparse.ArgumentParser()
    bench_cli.add_bench_parser(parser.add_subparsers())
    for argv, chunk in (([], StreamConfig.chunk), (["--stream-chunk", "48"], 48)):
        args = parser.parse_args(["bench", "stream", "--size", "tiny", *argv])
        assert args.func(args) == 0 and ran.pop().chunk == chunk
    with pytest.raises(ValueError, match="StreamConfig.chunk must be an int >= 1"):
        StreamBenchConfig(chunk=0)
    chat = load_bench_chat(StreamBenchConfig(size="tiny", device="cpu", chunk=40, json_path=None), 2)
    assert chat.pipeline.stream_config == StreamConfig(chunk=40)  # what the streams are cut by
