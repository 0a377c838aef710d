"""``chattts-velocity bench serve --rates`` (open loop): the playback, arrival and sustained-rate maths on hand-made
inputs, then Poisson arrivals against a live server over a tiny checkpoint (every request held to the same length):
every arrival is sent and counted once, in one client process or split over two, and non-200 answers, cut-off
bodies and requests still running after the drain are failures. Speed targets are judged on a GPU."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time

import numpy as np
import pytest
from server_helpers import API_KEY, ServerProcess

from chattts_velocity.bench.open_loop import (
    BYTES_PER_S,
    OpenLoopConfig,
    arrival_times,
    client_processes,
    playback,
    run_and_report,
    run_rate,
    sustained_rate,
)

TOKENS = 32
"""Audio tokens of every request (--min-new-token = --max-new-token)."""
RATES = (2.0, 5.0)
DURATION_S = 2.0


def piece(seconds: float) -> int:
    """pcm bytes of ``seconds`` of audio."""
    return round(seconds * BYTES_PER_S)


def test_start_delay_and_underrun_on_hand_made_timings():
    # 0.2 s pieces: the second comes 0.2 s after the first piece's audio ran out, the third 0.1 s after
    late = playback([0.05, 0.45, 0.65], [piece(0.2)] * 3)
    assert late["underrun"] and late["start_delay_s"] == pytest.approx(0.2)
    assert late["first_audio_s"] == 0.05 and late["audio_s"] == pytest.approx(0.6)
    # each piece before the audio ahead of it has played: no wait needed
    smooth = playback([0.05, 0.15, 0.35], [piece(0.2)] * 3)
    assert not smooth["underrun"] and smooth["start_delay_s"] == 0.0
    # a short first piece, then a long one on time, then a late one: the latest piece sets the delay
    assert playback([0.0, 0.1, 0.9], [piece(0.1), piece(0.5), piece(0.1)])["start_delay_s"] == pytest.approx(0.3)
    # within a millisecond is on time; pieces need not hold whole samples
    assert not playback([0.0, 0.2005], [piece(0.2), 1])["underrun"]
    assert playback([0.0, 0.1], [4801, 1])["start_delay_s"] == 0.0 < playback([0.0, 0.1], [4799, 1])["start_delay_s"]
    assert playback([0.0, 0.203], [piece(0.2), 1])["underrun"]


def test_arrival_times_are_poisson_for_a_seed():
    rate, duration = 40.0, 200.0
    times = arrival_times(rate, duration, 7)
    assert np.array_equal(times, arrival_times(rate, duration, 7))  # a run repeats
    assert not np.array_equal(times[:10], arrival_times(rate, duration, 8)[:10])
    assert 0 < times[0] and np.all(np.diff(times) > 0) and times[-1] < duration
    n = rate * duration
    assert abs(len(times) - n) < 4 * n**0.5
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)  # exponential gaps, not even spacing
    # k client processes at rate/k add up to the rate
    split = sum(len(arrival_times(rate / 4, duration, (7, i))) for i in range(4))
    assert abs(split - n) < 4 * n**0.5


def test_client_processes_follow_the_requests_in_flight():
    assert client_processes(5, 0.5, 16) == 1
    assert client_processes(80, 1.0, 16) == 5  # 80 requests in flight
    assert client_processes(0.1, 0.01, 16) == 1


def row(rate: float, p95: float | None = 50.0, underruns: int = 0, failed: int = 0, completed: int = 10) -> dict:
    return dict(rate=rate, first_audio_p95_ms=p95, underruns=underruns, failed=failed, completed=completed)


def test_sustained_rate_is_the_highest_met_with_every_lower_rate():
    assert sustained_rate([row(5), row(20), row(80, p95=151)], 150) == 20
    assert sustained_rate([row(80, p95=151), row(5), row(20)], 200) == 80  # in any order
    assert sustained_rate([row(5), row(20, underruns=1), row(80)], 150) == 5  # a lower rate's miss ends it
    assert sustained_rate([row(5, failed=1), row(20)], 150) is None
    assert sustained_rate([row(5, p95=None, completed=0)], 150) is None


@pytest.fixture(scope="module")
def server(upstream_ckpt):
    srv = ServerProcess(upstream_ckpt, "--max-new-token", str(TOKENS), "--min-new-token", str(TOKENS))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def report(server, tmp_path_factory) -> tuple[dict, str]:
    path = tmp_path_factory.mktemp("open_loop") / "bench_open_loop.json"
    cfg = OpenLoopConfig(url=server.url, rates=RATES, duration_s=DURATION_S, api_key=API_KEY, json_path=str(path))
    return run_and_report(cfg), str(path)


def test_every_arrival_is_sent_and_counted(report):
    rows = report[0]["rows"]
    assert [r["rate"] for r in rows] == list(RATES)
    for r in rows:
        drawn = len(arrival_times(r["rate"], DURATION_S, (0, round(r["rate"] * 1000), 1, 0)))
        assert r["arrivals"] == drawn == r["completed"] + r["failed"] and r["failed"] == 0, r
        assert r["offered_rate"] == pytest.approx(drawn / DURATION_S) and r["client_processes"] == 1
        assert 0 < r["achieved_rate"] <= r["offered_rate"] and r["wall_s"] >= DURATION_S
        assert 0 < r["first_audio_p50_ms"] <= r["first_audio_p95_ms"] <= r["first_audio_p99_ms"]
        assert 0 <= r["start_delay_p50_ms"] <= r["start_delay_p95_ms"] and 0 <= r["underruns"] <= r["completed"]
        per_request = r["audio_s_per_s"] / r["achieved_rate"]  # every request has the same length of audio
        assert (TOKENS - 2) * 512 / 24000 <= per_request <= TOKENS * 512 / 24000
        # the server's own means over the rate: its engine's two parts of first audio (the audio's share of the
        # second), and the whole
        means = r["server_mean_ms"]
        assert set(means) == {"to_first_token", "to_first_audio", "first_decode", "first_audio"}, means
        assert all(0 < v < 1e4 for v in means.values()), means
        assert means["first_decode"] <= means["to_first_audio"], means
        # and the engine thread's time over the rate, by part, which adds up to the whole
        shares = r["engine_thread"]
        assert set(shares) == {"idle", "step", "step_device_wait", "deliver", "deliver_device_wait"}, shares
        assert sum(shares.values()) == pytest.approx(1.0) and shares["step"] > 0, shares
        steps = r["engine_steps"]  # the engine's prompt steps and windows over the rate
        assert steps["prompt_steps"] >= 1 and steps["windows"] >= 1 and steps["mean_window_steps"] >= 1, steps
        assert steps["mean_batch"] >= 1, steps
        assert r["gpu_busy"] is None or 0 <= r["gpu_busy"] <= 1  # (None without nvidia-smi)


def test_report_has_the_sustained_rate_and_is_written(report, capsys):
    data, path = report
    with open(path) as f:
        assert json.load(f) == json.loads(json.dumps(data))
    assert data["sustained_rate"] == sustained_rate(data["rows"], 150.0)
    assert {"underruns", "start_delay_*_ms", "sustained_rate", "server_mean_ms"} <= data["definitions"].keys()
    assert data["config"]["rates"] == RATES and "api_key" not in data["config"]


def test_a_rate_split_over_client_processes_counts_every_arrival_once(server):
    cfg = OpenLoopConfig(url=server.url, rates=(4.0,), duration_s=DURATION_S, api_key=API_KEY, json_path=None)
    r = run_rate(cfg, 4.0, processes=2)
    drawn = sum(len(arrival_times(2.0, DURATION_S, (0, 4000, 2, i))) for i in range(2))
    assert r["client_processes"] == 2 and r["arrivals"] == drawn == r["completed"] and r["failed"] == 0, r
    assert r["first_audio_p50_ms"] > 0


def test_the_command_line_runs_the_open_loop(server, tmp_path, capsys):
    from chattts_velocity.cli import main

    path = tmp_path / "ol.json"
    assert main(["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--rates", "2", "--duration", "1",
                 "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["config"]["rates"] == [2.0] and data["rows"][0]["arrivals"] == data["rows"][0]["completed"]
    out = capsys.readouterr().out
    assert "sustained rate" in out and "server side, mean ms" in out and "2 req/s: " in out
    assert main(["bench", "--rates", "5"]) == 2
    assert "--rates drives a running server" in capsys.readouterr().err


def test_non_200_answers_are_failures(server):
    cfg = OpenLoopConfig(url=server.url, rates=(4.0,), duration_s=1.0, api_key="wrong", json_path=None)
    r = run_rate(cfg, 4.0)
    assert r["arrivals"] == r["failed"] > 0 and r["completed"] == 0 and r["statuses"] == ["401"]
    assert r["first_audio_p95_ms"] is None and not r["meets_target"]


class _Misbehaving(socketserver.BaseRequestHandler):
    """Answers GET with an empty 200; a POST with the start of a chunked pcm body, then closes (``cut``) or
    waits (``hang``)."""

    mode = "cut"

    def handle(self) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += self.request.recv(4096)
        if data.startswith(b"GET"):
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        self.request.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n" + bytes(16) + b"\r\n")
        if self.mode == "hang":
            self.request.settimeout(30)
            self.request.recv(1)  # until the client gives up


@pytest.mark.parametrize("mode, status", [("cut", "IncompleteReadError"), ("hang", "unfinished")])
def test_cut_off_and_unfinished_bodies_are_failures(mode, status, monkeypatch):
    monkeypatch.setattr(_Misbehaving, "mode", mode)
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Misbehaving) as fake:
        fake.daemon_threads = True
        threading.Thread(target=fake.serve_forever, daemon=True).start()
        cfg = OpenLoopConfig(url=f"http://127.0.0.1:{fake.server_address[1]}", rates=(5.0,), duration_s=1.0,
                             drain_s=0.5, json_path=None)
        begun = time.perf_counter()
        r = run_rate(cfg, 5.0)
        fake.shutdown()
    assert time.perf_counter() - begun < 1.0 + 0.5 + 2.0  # the window, the drain, and no more
    assert r["arrivals"] == r["failed"] > 0 and r["statuses"] == [status], r
    assert r["unfinished"] == (r["failed"] if mode == "hang" else 0)
    assert "after 16 bytes" in r["errors"][0]


def test_no_server_fails_before_the_run(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "r.json"
    with pytest.raises(ValueError, match=f"the warm-up request to http://127.0.0.1:{port} failed"):
        run_and_report(OpenLoopConfig(url=f"http://127.0.0.1:{port}", rates=(1.0,), json_path=str(path)))
    assert not path.exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"rates": (5.0, 0.0)}, "--rates must be numbers > 0"),
    ({"rates": ()}, "--rates must be numbers > 0"),
    ({"duration_s": 0}, "--duration must be > 0"),
    ({"p95_target_ms": -1}, "--p95-target-ms must be > 0"),
    ({"url": "ftp://x"}, "plain http:// server"),
])
def test_bad_settings_say_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OpenLoopConfig(**kwargs)


def test_server_means_come_from_the_metrics_before_and_after_a_rate():
    """``server_mean_ms``: each histogram's sum and count summed over its series (fronts, replicas), the
    difference across the rate as a mean; None without both scrapes or without a new observation."""
    from chattts_velocity.bench.server_metrics import SERVER_MEANS, format_means, server_means

    token, audio, whole = SERVER_MEANS["to_first_token"], SERVER_MEANS["to_first_audio"], SERVER_MEANS["first_audio"]
    before = {token: (1.0, 10.0), audio: (0.5, 10.0), whole: (2.0, 10.0)}
    after = {token: (1.3, 13.0), audio: (0.5, 10.0), whole: (2.6, 13.0)}
    means = server_means(before, after)
    assert means["to_first_token"] == pytest.approx(100.0) and means["first_audio"] == pytest.approx(200.0)
    assert means["to_first_audio"] is None and server_means(None, after) is None
    assert means["first_decode"] is None, "a histogram on neither page"
    assert format_means(means) == "100.0, - (-); 200.0"


def test_server_sums_add_every_series_of_a_histogram():
    """``page_sums`` reads a /metrics page whose histograms have several series (fronts summed already,
    replicas labelled apart) and adds them; a page that cannot be read gives None."""
    import http.server
    import threading

    from chattts_velocity.bench.server_metrics import metrics_page, page_sums

    page = "\n".join([
        "# TYPE chattts_engine_first_token_seconds histogram",
        'chattts_engine_first_token_seconds_bucket{replica="a",le="+Inf"} 3.0',
        'chattts_engine_first_token_seconds_sum{replica="a"} 0.25',
        'chattts_engine_first_token_seconds_count{replica="a"} 3.0',
        'chattts_engine_first_token_seconds_sum{replica="b"} 0.5',
        'chattts_engine_first_token_seconds_count{replica="b"} 2.0',
        "chattts_time_to_first_audio_seconds_sum 1.5",
        "chattts_time_to_first_audio_seconds_count 5.0",
        "chattts_time_to_first_audio_seconds_created 1.7e+09", ""]).encode()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        sums = page_sums(metrics_page(f"http://127.0.0.1:{httpd.server_port}/"))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert sums["chattts_engine_first_token_seconds"] == (pytest.approx(0.75), 5.0)
    assert sums["chattts_time_to_first_audio_seconds"] == (1.5, 5.0)
    assert sums["chattts_engine_first_audio_seconds"] == (0.0, 0.0)  # not on the page
    assert page_sums(metrics_page(f"http://127.0.0.1:{httpd.server_port}/")) is None  # nobody listens now


def test_the_engine_threads_shares_come_from_its_counters_before_and_after():
    """``engine_thread``: the counters of every series (replicas) added, their growth over the rate as shares of
    the whole; None without both pages or on a server without the family."""
    from chattts_velocity.bench.server_metrics import format_shares, thread_seconds, thread_shares

    def page(idle: float, step: float, wait: float) -> str:
        return "\n".join([
            "# TYPE chattts_engine_thread_seconds counter",
            f'chattts_engine_thread_seconds_total{{part="idle"}} {idle}',
            f'chattts_engine_thread_seconds_total{{part="step"}} {step}',
            f'chattts_engine_thread_seconds_total{{part="step_device_wait"}} {wait}',
            f'chattts_engine_thread_seconds_total{{replica="b",part="step"}} {step}',
            'chattts_engine_thread_seconds_created{part="idle"} 1.7e+09', ""])

    before, after = thread_seconds(page(1.0, 2.0, 0.5)), thread_seconds(page(2.0, 3.0, 2.5))
    assert before == {"idle": 1.0, "step": 4.0, "step_device_wait": 0.5}
    shares = thread_shares(before, after)
    assert shares == {"idle": pytest.approx(0.2), "step": pytest.approx(0.4), "step_device_wait": pytest.approx(0.4)}
    assert format_shares(shares) == "idle 20%, step 40% + device wait 40%, deliver 0%"
    assert thread_seconds("chattts_engine_loop_seconds_count 3.0") is None and thread_seconds(None) is None
    assert thread_shares(None, after) is None and thread_shares(after, after) is None  # no time passed


def _report_imports(tag: str, barrier, out) -> None:
    """A bench client process's target (``run_client_processes``): what it had imported by the time it ran."""
    import sys

    barrier.wait()
    out.put((tag, "torch" in sys.modules, "chattts_velocity.chat" in sys.modules))


def _report_times(tag: str, barrier, out) -> None:
    """A bench client process's target: when it was ready, and when it was let go."""
    ready = time.time()
    barrier.wait()
    out.put((tag, ready, time.time()))


def test_bench_client_processes_start_without_torch(tmp_path):
    """The load generator's processes run their target without importing the parent's main module (under the
    CLI: torch and the model) or the package's heavy parts; the parent's main is left as it was.
    The parent here is a script that imports torch at its top, as the CLI does."""
    import os
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import sys\n"
        "import torch  # as the CLI imports it\n"
        "from test_bench_open_loop import _report_imports\n"
        "from chattts_velocity.bench.serve import run_client_processes\n"
        "def mine(tag, barrier, out):\n"
        "    barrier.wait()\n"
        "    out.put((tag, 'torch' in sys.modules))\n"
        "if __name__ == '__main__':\n"
        "    before = sys.modules['__main__'].__file__\n"
        "    parts, _ = run_client_processes(_report_imports, [('a',), ('b',)], timeout_s=60)\n"
        "    print(sorted(parts), sys.modules['__main__'].__file__ == before)\n"
        "    parts, _ = run_client_processes(mine, [('c',)], timeout_s=60)\n"  # a target in __main__: imported
        "    print(parts)\n"
        "    import time\n"
        "    from test_bench_open_loop import _report_times\n"
        "    marks = []\n"  # on_start: once every process waits, before any is let go
        "    parts, _ = run_client_processes(_report_times, [('x',), ('y',)], timeout_s=60,\n"
        "                                    on_start=lambda: marks.append(time.time()))\n"
        "    print(len(marks) == 1 and max(p[1] for p in parts) <= marks[0] <= min(p[2] for p in parts))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == ["[('a', False, False), ('b', False, False)] True", "[('c', True)]",
                                          "True"]


def test_the_engines_windows_come_from_its_counters_before_and_after():
    """``engine_steps``: each step counter of every series added, the windows and their means over the rate;
    None without both pages or on a server without the counters."""
    from chattts_velocity.bench.server_metrics import engine_counts, format_windows, windows_between

    def page(prompts: int, windows: int, steps: int, tokens: int) -> str:
        return "\n".join([
            f"chattts_engine_prompt_steps_total {prompts}", f"chattts_engine_windows_total {windows}",
            f'chattts_engine_window_steps_total{{replica="a"}} {steps}',
            f'chattts_engine_window_steps_total{{replica="b"}} {steps}',
            f"chattts_engine_window_tokens_total {tokens}", "chattts_engine_windows_created 1.7e+09", ""])

    before, after = engine_counts(page(2, 10, 50, 400)), engine_counts(page(6, 30, 150, 2400))
    assert before == {"prompt_steps": 2.0, "windows": 10.0, "window_steps": 100.0, "window_tokens": 400.0}
    steps = windows_between(before, after)
    assert steps == {"prompt_steps": 4, "windows": 20, "mean_window_steps": 10.0, "mean_batch": 10.0}
    assert format_windows(steps) == "20 decode windows of 10.0 steps at a batch of 10.0, 4 prompt steps"
    assert windows_between(before, before)["mean_window_steps"] is None
    assert format_windows(windows_between(before, before)) == "0 prompt steps, no decode window"
    assert engine_counts("chattts_engine_windows_total 3") is None and windows_between(None, after) is None


def test_gpu_busy_samples_nvidia_smi_for_a_server_on_this_machine(tmp_path, monkeypatch):
    """``GpuBusy``: nvidia-smi's utilization (every GPU, every sample) averaged over the block it wraps, for a
    loopback server only; None without nvidia-smi, for a remote server, or without a sample."""
    import os
    import stat

    from chattts_velocity.bench.server_metrics import GpuBusy, format_engine

    fake = tmp_path / "nvidia-smi"  # two GPUs, a line each per sample, until stopped
    fake.write_text("#!/bin/sh\nwhile true; do echo 30; echo 50; sleep 0.02; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for url in ("http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:8000"):
        with GpuBusy(url) as gpu:
            time.sleep(0.3)
        assert gpu.samples >= 4 and gpu.mean == pytest.approx(0.4, abs=0.1), (url, gpu.samples, gpu.mean)
    with GpuBusy("http://10.0.0.7:8000") as remote:  # another machine's GPU is not this one's
        time.sleep(0.05)
    assert remote.mean is None and remote.samples == 0
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with GpuBusy("http://127.0.0.1:8000") as missing:
        pass
    assert missing.mean is None
    row = {"gpu_busy": 0.375, "engine_thread": {"idle": 0.5, "step": 0.5},
           "engine_steps": {"prompt_steps": 1, "windows": 0, "mean_window_steps": None, "mean_batch": None}}
    assert format_engine(row) == ("GPU busy 38%; engine thread idle 50%, step 50%, deliver 0%; 1 prompt steps, "
                                  "no decode window")
    assert format_engine({"gpu_busy": None, "engine_thread": None}) == ""


def test_readings_start_where_the_clients_start(monkeypatch):
    """``Readings.start`` (what a level calls once its clients are ready) takes the page the readings count
    from: the engine thread's idle time while the clients started is not in a level's shares; a block that
    never started reads nothing."""
    from chattts_velocity.bench import server_metrics

    pages = iter([f'chattts_engine_thread_seconds_total{{part="idle"}} {idle}\n'
                  f'chattts_engine_thread_seconds_total{{part="step"}} {step}\n' for idle, step in ((5, 0), (6, 3))])
    monkeypatch.setattr(server_metrics, "metrics_page", lambda url: next(pages))
    with server_metrics.Readings("http://10.0.0.7:8000") as server:
        pass  # the clients start: nothing is read
    assert server.fields() == {"engine_thread": None, "engine_steps": None, "server_mean_ms": None, "gpu_busy": None}
    with server_metrics.Readings("http://10.0.0.7:8000") as server:
        server.start()  # the engine thread idled 5 s before it
    assert server.fields()["engine_thread"] == pytest.approx({"idle": 0.25, "step": 0.75})
