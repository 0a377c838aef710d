"""``chattts-velocity bench serve --rates``: open-loop load on a running speech server. Per rate (req/s), requests
arrive as a Poisson process for a fixed window (seeded, so a run repeats), each a POST /v1/audio/speech streaming
pcm on a connection of its own, sent whether or not the earlier ones have finished (unlike the closed-loop levels,
where a client waits for its last request). Per rate: offered and achieved rate, first audio p50/p95/p99, playback
underruns and the start delay that would have avoided them, failures; then the highest rate tried that the server
sustains (first audio p95 within a target, no underrun, no failure). A rate's arrivals are split over client
processes, each its own Poisson stream at rate/k (their sum is Poisson at the rate), so that one client's event
loop does not limit the rate."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..constants import SAMPLE_RATE
from .http_client import Connection
from .playback import StreamRecord
from .report import prepare_output, write_json
from .serve import CLIENT_BOUND, TEXT, run_client_processes
from .server_metrics import MEANS_LEGEND, Readings, cell, format_engine, format_means

BYTES_PER_S = 2 * SAMPLE_RATE
"""pcm: 16-bit mono samples at 24 kHz."""
LAG_BOUND_S = 0.01
"""A rate whose requests were sent later than their arrival time by more than this (p99) is reported as maybe
client-bound."""
DEFINITIONS = {
    "offered_rate": "requests sent per second of the window (the Poisson draw, near the rate asked for)",
    "achieved_rate": "requests that succeeded per second, from the window's start until the later of its end and "
                     "the last request's end (as vLLM's benchmark_serving counts request throughput)",
    "first_audio_*_ms": "request sent (before its connection opened) -> first audio byte, successful requests",
    "underruns": "successful requests whose playback, started at their first audio byte (24 kHz 16-bit mono), "
                 "would stall: a piece of the body arriving over 1 ms after the audio before it had played",
    "start_delay_*_ms": "per successful request, the smallest wait after its first byte before playback that never "
                        "stalls (0 when it never would)",
    "failed": "non-200 answers, bodies cut off or empty, requests still running drain_s after the window ended",
    "unfinished": "of the failed, those still running drain_s after the window ended",
    "send_lag_p99_ms": "how late a request was sent after its Poisson arrival time (the client's own delay)",
    "sustained_rate": "the highest rate tried such that it and every lower rate tried had first audio p95 within "
                      "p95_target_ms, no underrun and no failure",
    "server_mean_ms": "the server's own means over the rate (its /metrics before and after it; None where it has "
                      "none): to_first_token, a request submitted to the engine to its first token (the wait for "
                      "the running step, its prompt step); to_first_audio, from there to its first audio (its "
                      "first window, the audio round); first_decode, the audio's part of to_first_audio (its "
                      "first window's tokens handed to the audio pump to its first audio: the pump's hold for a "
                      "safe start, the decode); first_audio, the HTTP request's start to its first audio",
    "engine_thread": "each part's share of the engine thread's time over the rate (the server's /metrics before "
                     "and after it; None where it has none): idle (no work), step (scheduling, launching, "
                     "reading outputs), deliver (the audio round on the engine thread), each *_device_wait its "
                     "waits for the GPU; a server whose thread mostly waits for the device is bound by it",
    "engine_steps": "the engine's prompt steps and decode windows over the rate (its /metrics), with the mean "
                    "window in steps (a host turn each) and the mean decode batch",
    "gpu_busy": "this machine's GPU utilization over the rate (nvidia-smi: the share of time a kernel ran, every "
                "100 ms, mean over GPUs and samples), for a server on this machine; None otherwise",
}


@dataclass(frozen=True)
class OpenLoopConfig:
    """One ``bench serve --rates`` run."""

    url: str = "http://127.0.0.1:8000"
    rates: tuple[float, ...] = (5.0, 20.0, 80.0)
    """Arrival rates to try, requests per second, each for ``duration_s``."""
    duration_s: float = 30.0
    """The window of each rate: requests arrive during it only."""
    p95_target_ms: float = 150.0
    """First audio p95 a rate must stay within to count as sustained."""
    seed: int = 0
    """Seed of the arrival times."""
    drain_s: float = 30.0
    """How long the requests still running at the window's end are awaited; those left then are failures."""
    streams_per_process: int = 16
    """Requests in flight per client process, expected from the rate and a warm-up request's length (Little's
    law); a rate that expects more is split over several processes (``ServeBenchConfig.streams_per_process``)."""
    api_key: str | None = None
    voice: str = "alloy"
    text: str = TEXT
    """Every request's input: its length is the server's (``serve --min-new-token/--max-new-token``)."""
    json_path: str | None = "bench_open_loop.json"

    def __post_init__(self) -> None:
        if not self.rates or any(not isinstance(r, (int, float)) or not r > 0 for r in self.rates):
            raise ValueError(f"--rates must be numbers > 0 (requests per second), got {self.rates!r}")
        for flag, value in (("duration", self.duration_s), ("p95-target-ms", self.p95_target_ms),
                            ("drain", self.drain_s)):
            if not value > 0:
                raise ValueError(f"--{flag} must be > 0, got {value!r}")
        if not isinstance(self.streams_per_process, int) or self.streams_per_process < 1:
            raise ValueError(f"--streams-per-process must be an int >= 1, got {self.streams_per_process!r}")
        Connection(self.url)


def arrival_times(rate: float, duration_s: float, seed) -> np.ndarray:
    """Seconds from the window's start of a Poisson process's arrivals at ``rate`` within ``duration_s``
    (exponential gaps of mean 1/rate); ``seed`` as ``np.random.default_rng`` takes it."""
    rng, times = np.random.default_rng(seed), []
    t = rng.exponential(1 / rate)
    while t < duration_s:
        times.append(t)
        t += rng.exponential(1 / rate)
    return np.array(times)


def client_processes(rate: float, request_s: float, streams_per_process: int) -> int:
    """Client processes for ``rate``: requests expected in flight (rate x request length) per
    ``streams_per_process``, at least one."""
    return max(1, math.ceil(rate * request_s / streams_per_process))


def playback(arrivals: list[float], sizes: list[int]) -> dict:
    """A successful request's figures from its body's pieces (seconds from the request, pcm bytes)."""
    record = StreamRecord(arrivals, [s / 2 for s in sizes])
    return {"ok": True, "status": 200, "first_audio_s": arrivals[0], "underrun": record.underrun(),
            "start_delay_s": record.start_delay(), "audio_s": sum(sizes) / BYTES_PER_S}


async def speech_request(cfg: OpenLoopConfig, seed: int, deadline: float) -> dict:
    """One pcm request on a new connection, over by ``deadline`` (the event loop's clock): its playback figures,
    or why it failed."""
    body = json.dumps({"model": "tts-1", "voice": cfg.voice, "input": cfg.text, "response_format": "pcm",
                       "seed": seed}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/octet-stream"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    conn, start, arrivals, sizes, status = Connection(cfg.url), time.perf_counter(), [], [], None
    try:
        async with asyncio.timeout_at(deadline):
            status = await conn.request("POST", "/v1/audio/speech", headers, body)
            async for piece in conn.body():
                arrivals.append(time.perf_counter() - start)
                sizes.append(len(piece))
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        kind = "unfinished" if isinstance(e, TimeoutError) else type(e).__name__
        return {"ok": False, "status": kind, "error": f"{kind} after {sum(sizes)} bytes, "
                f"{time.perf_counter() - start:.2f} s: {e!r}"[:300]}
    finally:
        await conn.close()
    if status != 200 or not sizes:
        return {"ok": False, "status": status, "error": f"HTTP {status}" + ("" if sizes else ", no body")}
    return playback(arrivals, sizes)


async def _arrivals(cfg: OpenLoopConfig, rate: float, part: int, parts: int, barrier=None):
    """Client ``part`` of ``parts`` at ``rate``: its Poisson share of the window's arrivals, each sent at its
    time. Every result, the seconds from the window's start to the last end, and this process's CPU seconds."""
    times = arrival_times(rate / parts, cfg.duration_s, (cfg.seed, round(rate * 1000), parts, part))
    warm = Connection(cfg.url)  # the client's own first-use costs, before the window
    try:
        async with asyncio.timeout(cfg.drain_s):
            await warm.request("GET", "/health", {})
            async for _ in warm.body():
                pass
    except Exception:  # noqa: BLE001 - the timed requests fail too and are counted
        pass
    finally:
        await warm.close()
    if barrier is not None:
        await asyncio.to_thread(barrier.wait)
    start, cpu, loop = time.perf_counter(), time.process_time(), asyncio.get_running_loop()
    deadline = loop.time() + cfg.duration_s + cfg.drain_s

    async def one(n: int, t: float) -> dict:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        lag = time.perf_counter() - start - t
        result = await speech_request(cfg, part * 1_000_000 + n, deadline)
        return {**result, "lag_s": lag, "end_s": time.perf_counter() - start}

    results = await asyncio.gather(*(one(n, t) for n, t in enumerate(times)))
    return list(results), max((r["end_s"] for r in results), default=0.0), time.process_time() - cpu


def _client_process(cfg: OpenLoopConfig, rate: float, part: int, parts: int, barrier, out) -> None:
    out.put(asyncio.run(_arrivals(cfg, rate, part, parts, barrier)))


def run_rate(cfg: OpenLoopConfig, rate: float, processes: int = 1, on_start=None) -> dict:
    """One rate's row, its arrivals in this process or split over ``processes`` started together; ``on_start``
    is called as the arrivals begin."""
    if processes == 1:
        if on_start is not None:
            on_start()
        return summary(cfg, rate, [asyncio.run(_arrivals(cfg, rate, 0, 1))])
    parts, _ = run_client_processes(_client_process, [(cfg, rate, i, processes) for i in range(processes)],
                                    cfg.duration_s + cfg.drain_s + 60, on_start)
    return summary(cfg, rate, parts)


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) * 1e3 if xs else None


def summary(cfg: OpenLoopConfig, rate: float, parts: list[tuple[list[dict], float, float]]) -> dict:
    """A rate's row from its client processes' (results, seconds to the last end, CPU seconds)."""
    results = [r for rs, _, _ in parts for r in rs]
    ok = [r for r in results if r["ok"]]
    span = max([cfg.duration_s, *(s for _, s, _ in parts)])
    first, delay = [r["first_audio_s"] for r in ok], [r["start_delay_s"] for r in ok]
    row = dict(
        rate=rate, duration_s=cfg.duration_s, arrivals=len(results), completed=len(ok),
        failed=len(results) - len(ok), unfinished=sum(r["status"] == "unfinished" for r in results),
        offered_rate=len(results) / cfg.duration_s, achieved_rate=len(ok) / span,
        first_audio_p50_ms=_pct(first, 50), first_audio_p95_ms=_pct(first, 95), first_audio_p99_ms=_pct(first, 99),
        underruns=sum(r["underrun"] for r in ok),
        start_delay_p50_ms=_pct(delay, 50), start_delay_p95_ms=_pct(delay, 95),
        audio_s_per_s=sum(r["audio_s"] for r in ok) / span,
        statuses=sorted({str(r["status"]) for r in results}), errors=[r["error"] for r in results if "error" in r][:5],
        send_lag_p99_ms=_pct([r["lag_s"] for r in results], 99), wall_s=span, client_processes=len(parts),
        client_cpu_s=max(cpu for _, _, cpu in parts))
    return dict(row, meets_target=meets_target(row, cfg.p95_target_ms))


def meets_target(row: dict, p95_target_ms: float) -> bool:
    """Whether a rate was sustained: some requests, none failed, none underran, first audio p95 within target."""
    return (row["completed"] > 0 and row["failed"] == 0 and row["underruns"] == 0
            and row["first_audio_p95_ms"] <= p95_target_ms)


def sustained_rate(rows: list[dict], p95_target_ms: float) -> float | None:
    """The highest rate of ``rows`` that, with every lower one, met the target; None if the lowest did not."""
    best = None
    for row in sorted(rows, key=lambda r: r["rate"]):
        if not meets_target(row, p95_target_ms):
            break
        best = row["rate"]
    return best


def format_table(rows: list[dict]) -> str:
    lines = ["| rate req/s | offered | achieved | first audio p50 ms | p95 ms | p99 ms | underruns "
             "| start delay p50 ms | p95 ms | requests | failed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']:g} | {r['offered_rate']:.1f} | {r['achieved_rate']:.1f} | "
                     f"{cell(r['first_audio_p50_ms'])} | {cell(r['first_audio_p95_ms'])} | "
                     f"{cell(r['first_audio_p99_ms'])} | {r['underruns']} | {cell(r['start_delay_p50_ms'])} | "
                     f"{cell(r['start_delay_p95_ms'])} | {r['arrivals']} | {r['failed']} |")
    return "\n".join(lines)


async def _warm_up(cfg: OpenLoopConfig) -> float:
    """Two untimed requests, one after the other (connections, whatever the server warms lazily): the seconds
    the last took. A server that fails them fails the run before it starts."""
    loop = asyncio.get_running_loop()
    for seed in (0, 1):
        begun = time.perf_counter()
        result = await speech_request(cfg, seed, loop.time() + cfg.duration_s + cfg.drain_s)
        if not result["ok"]:
            raise ValueError(f"bench serve --rates: the warm-up request to {cfg.url} failed: {result['error']}")
    return time.perf_counter() - begun


def _measured_rate(cfg: OpenLoopConfig, rate: float, processes: int) -> dict:
    with Readings(cfg.url) as server:
        row = run_rate(cfg, rate, processes, server.start)
    return dict(row, **server.fields())


def run_and_report(cfg: OpenLoopConfig) -> dict:
    if cfg.json_path:
        prepare_output(cfg.json_path)
    request_s = asyncio.run(_warm_up(cfg))
    rows = [_measured_rate(cfg, rate, client_processes(rate, request_s, cfg.streams_per_process))
            for rate in cfg.rates]
    best = sustained_rate(rows, cfg.p95_target_ms)
    config = {k: v for k, v in asdict(cfg).items() if k != "api_key"}  # a results file is shared; a key is not
    report = {"config": config, "definitions": DEFINITIONS, "rows": rows, "sustained_rate": best}
    print(f"server {cfg.url}, pcm streaming, Poisson arrivals for {cfg.duration_s:g} s per rate (seed {cfg.seed})")
    print(format_table(rows))
    print(f"sustained rate (first audio p95 <= {cfg.p95_target_ms:g} ms, no underrun, no failure): "
          + (f"{best:g} req/s" if best is not None else "none of the rates tried"))
    means = [(r["rate"], r["server_mean_ms"]) for r in rows if r.get("server_mean_ms")]
    if means:
        print(f"server side, mean ms ({MEANS_LEGEND}): "
              + "; ".join(f"{rate:g} req/s: {format_means(m)}" for rate, m in means))
    for r in rows:
        if line := format_engine(r):
            print(f"at {r['rate']:g} req/s: {line}")
    for r in rows:
        if r["client_cpu_s"] > CLIENT_BOUND * r["wall_s"] or (r["send_lag_p99_ms"] or 0) > LAG_BOUND_S * 1e3:
            print(f"warning: at {r['rate']:g} req/s a client process was busy {r['client_cpu_s']:.1f} s of "
                  f"{r['wall_s']:.1f} s and sent requests {cell(r['send_lag_p99_ms'])} ms late (p99): the "
                  "client may be the bottleneck (lower --streams-per-process)")
    if cfg.json_path:
        write_json(report, cfg.json_path)
    return report
