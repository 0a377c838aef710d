"""``chattts-velocity bench serve``: drive a running speech server over HTTP at a sweep of concurrency levels
(N clients each streaming one pcm request at a time, all started together) and report per level: time to first
audio p50/p99, inter-chunk gap p99, real-time factor per stream (slowest and median) and in total (seconds
of audio of the whole level per second of its wall time: what several replicas add up to), failures. JSON, a
markdown table and optionally a PNG."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..constants import SAMPLE_RATE
from .http_client import Connection
from .report import require_matplotlib
from .server_metrics import MEANS_LEGEND, Readings, format_engine, format_means

TEXT = "Streaming speech for many users at once, chunk by chunk, as soon as it is generated."


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str = "http://127.0.0.1:8000"
    streams: tuple[int, ...] = (1, 8, 64, 256)
    requests_per_stream: int = 2
    """Requests each client makes in a row (all counted)."""
    api_key: str | None = None
    voice: str = "alloy"
    text: str = TEXT
    timeout_s: float = 300.0
    json_path: str | None = "bench_serve.json"
    plot_path: str | None = None
    streams_per_process: int = 16
    """Clients driven by one client process: a level of more streams is split over several processes, started
    together, so that the clients' own event loops do not become what is measured (``bench serve
    --streams-per-process``; docs/perf/)."""
    trace: bool = False
    """Keep every request's times in the level's row (``traced``: its ``time.monotonic`` when sent, then
    seconds to the headers, to the first audio and to the end, and its seconds of audio) and send each with an ``X-Request-Id``
    (``bench-<random hex>``), so a server's own timestamps can be matched to them."""

    def __post_init__(self) -> None:
        if not self.streams or any(not isinstance(n, int) or n < 1 for n in self.streams):
            raise ValueError(f"--streams must be ints >= 1, got {self.streams!r}")
        if self.requests_per_stream < 1:
            raise ValueError("--requests-per-stream must be >= 1")
        if not isinstance(self.streams_per_process, int) or self.streams_per_process < 1:
            raise ValueError(f"--streams-per-process must be an int >= 1, got {self.streams_per_process!r}")
        if self.plot_path:
            require_matplotlib()


START_TIMEOUT_S = 120.0
"""How long a level's client processes may take to start (import, connect) before the run fails."""

CLIENT_BOUND = 0.8
"""A level with a client process on the CPU over this share of the wall time is reported as maybe client-bound
(a busy asyncio loop delays its streams well before it is saturated: see ``streams_per_process``)."""


async def _one(conn: Connection, cfg: ServeBenchConfig, seed: int) -> dict:
    body = json.dumps({"model": "tts-1", "voice": cfg.voice, "input": cfg.text, "response_format": "pcm",
                       "seed": seed}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/octet-stream"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    rid = f"bench-{uuid.uuid4().hex[:16]}"
    if cfg.trace:
        headers["X-Request-Id"] = rid
    sent, start, arrivals, size = time.monotonic(), time.perf_counter(), [], 0
    try:
        async with asyncio.timeout(cfg.timeout_s):
            status = await conn.request("POST", "/v1/audio/speech", headers, body)
            head = time.perf_counter() - start  # the status line and headers: the server has prepared the request
            pieces = conn.body()
            if status != 200:
                async for _ in pieces:
                    pass
                return {"ok": False, "status": status}
            async for piece in pieces:
                arrivals.append(time.perf_counter() - start)
                size += len(piece)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        await conn.close()  # whatever it was in the middle of, the next request starts afresh
        when = f"after {size} bytes, {time.perf_counter() - start:.2f} s" if arrivals else "before any byte"
        return {"ok": False, "status": type(e).__name__, "error": f"{type(e).__name__} {when}: {e!r}"[:300]}
    wall = time.perf_counter() - start
    gaps = np.diff(arrivals) if len(arrivals) > 1 else np.zeros(1)
    return {"ok": size > 0, "status": 200, "ttfa": arrivals[0] if arrivals else None, "gap_max": float(gaps.max()),
            "rtf": size / 2 / SAMPLE_RATE / wall, "audio_s": size / 2 / SAMPLE_RATE, "head": head, "wall": wall,
            "id": rid, "sent": sent}


async def _users(cfg: ServeBenchConfig, users: range, barrier=None, on_start=None) -> tuple[list[dict], float, float]:
    """Each user (a client) makes ``requests_per_stream`` requests in a row on a connection of its own: every
    result (in no order), and the ``perf_counter`` and ``process_time`` when the timed part began.

    Before it each user's connection is opened (a ``GET /health`` each, at once), then ``barrier`` (if any) is
    waited for, so a level times the server and not the clients' own start: 16 client processes started
    together connect their streams on the cores the server uses. ``on_start`` (in one process, no barrier): called
    as the timed part begins."""
    conns = [Connection(cfg.url) for _ in users]

    async def warm(conn: Connection) -> None:
        await conn.request("GET", "/health", {})
        async for _ in conn.body():
            pass

    # a failed warm-up request is not fatal: the timed ones fail too and are counted
    await asyncio.gather(*(warm(conn) for conn in conns), return_exceptions=True)
    if barrier is not None:
        await asyncio.to_thread(barrier.wait)
    elif on_start is not None:
        on_start()
    start, cpu = time.perf_counter(), time.process_time()

    async def user(u: int, conn: Connection) -> list[dict]:
        results = []
        for k in range(cfg.requests_per_stream):
            results.append({**await _one(conn, cfg, u * cfg.requests_per_stream + k), "nth": k})
        await conn.close()
        return results

    return [r for rs in await asyncio.gather(*(user(u, c) for u, c in zip(users, conns, strict=True))) for r in rs], \
        start, cpu


def _client_process(cfg: ServeBenchConfig, users: range, barrier, out) -> None:
    """One client process of a level: gets ready, waits for its siblings, runs its users, reports its results
    and CPU time."""
    results, _, cpu = asyncio.run(_users(cfg, users, barrier))
    out.put((results, time.process_time() - cpu))


def _level(cfg: ServeBenchConfig, n: int, on_start=None) -> dict:
    """One level: ``n`` concurrent clients, in one process (this one) or split over several; ``on_start`` is
    called once every client is ready, as they start sending."""
    procs = -(-n // cfg.streams_per_process)
    if procs == 1:
        results, start, cpu = asyncio.run(_users(cfg, range(n), on_start=on_start))
        return _summary(n, results, time.perf_counter() - start, [time.process_time() - cpu], cfg.trace)
    bounds = [n * i // procs for i in range(procs + 1)]
    parts, wall = run_client_processes(_client_process, [(cfg, range(bounds[i], bounds[i + 1])) for i in range(procs)],
                                       cfg.timeout_s * cfg.requests_per_stream + 60, on_start)
    return _summary(n, [r for results, _ in parts for r in results], wall, [cpu for _, cpu in parts], cfg.trace)


def run_client_processes(target, args: list[tuple], timeout_s: float, on_start=None) -> tuple[list, float]:
    """``target(*args[i], barrier, out)`` in one spawned process per ``args`` item, all released together once
    every one is ready (imported, connected; ``on_start`` is called then, before the release); each puts one
    result on ``out``. Returns the results and the wall time from the release; a process that dies, or results
    later than ``timeout_s``, fail the run."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (and torch)
    barrier, out = ctx.Barrier(len(args) + 1), ctx.Queue()
    workers = [ctx.Process(target=target, args=(*a, barrier, out), daemon=True) for a in args]
    with _main_hidden() if getattr(target, "__module__", "__main__") != "__main__" else contextlib.nullcontext():
        for w in workers:
            w.start()
    try:
        try:
            ready_by = time.monotonic() + START_TIMEOUT_S
            while barrier.n_waiting < len(args) and time.monotonic() < ready_by:
                time.sleep(0.005)
            if on_start is not None and barrier.n_waiting == len(args):
                on_start()
            barrier.wait(timeout=max(ready_by - time.monotonic(), 0.1))  # every one ready: the run starts now
        except threading.BrokenBarrierError:
            raise RuntimeError(f"the {len(args)} bench client processes did not all start within "
                               f"{START_TIMEOUT_S:g} s") from None
        start = time.perf_counter()
        parts = gather_parts(out, workers, timeout_s)
        return parts, time.perf_counter() - start
    finally:
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()


@contextlib.contextmanager
def _main_hidden():
    """While processes are spawned, this process's ``__main__`` as one they need not run: a spawned child first
    re-imports its parent's main module (the CLI, which imports torch and the model code: docs/perf/serve.md),
    and a bench client needs only its target's module (``chattts_velocity`` imports the rest when first used).
    Not for a target that lives in ``__main__`` itself, which the child must import to find it."""
    space = vars(sys.modules["__main__"])
    saved = {name: space[name] for name in ("__spec__", "__file__") if name in space}
    space["__spec__"] = None
    space.pop("__file__", None)
    try:
        yield
    finally:
        space.pop("__spec__", None)
        space.update(saved)


def gather_parts(out, workers, timeout_s: float) -> list:
    """One result per client process; a process that died without one fails the level at once."""
    import queue

    parts, deadline = [], time.monotonic() + timeout_s
    while len(parts) < len(workers):
        try:
            parts.append(out.get(timeout=1))
            continue
        except queue.Empty:
            pass
        dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"a bench client process died (exit code {dead[0]}) before reporting its results")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the bench client processes did not finish within {timeout_s:.0f} s")
    return parts


def _summary(n: int, results: list[dict], wall: float, cpu: list[float], trace: bool = False) -> dict:
    ok = [r for r in results if r["ok"]]
    traced = {"traced": [{k: r[k] for k in ("id", "nth", "sent", "head", "ttfa", "wall", "audio_s")} for r in ok]} if trace else {}
    pct = (lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan"))  # noqa: E731
    return dict(streams=n, requests=len(results), failures=len(results) - len(ok),
                statuses=sorted({str(r["status"]) for r in results}),
                errors=[r["error"] for r in results if "error" in r][:5],
                ttfa_p50_ms=pct([r["ttfa"] for r in ok], 50), ttfa_p99_ms=pct([r["ttfa"] for r in ok], 99),
                # the clients' first requests (all sent at once) against the later ones (each sent as its
                # client's previous request ends)
                ttfa_p99_first_ms=pct(first, 99) if (first := [r["ttfa"] for r in ok if r["nth"] == 0]) else None,
                ttfa_p99_later_ms=pct(later, 99) if (later := [r["ttfa"] for r in ok if r["nth"] > 0]) else None,
                headers_p50_ms=pct([r["head"] for r in ok], 50), headers_p99_ms=pct([r["head"] for r in ok], 99),
                request_p50_ms=pct([r["wall"] for r in ok], 50),
                gap_p99_ms=pct([r["gap_max"] for r in ok], 99),
                rtf_min=min((r["rtf"] for r in ok), default=float("nan")),
                rtf_p50=float(np.median([r["rtf"] for r in ok])) if ok else float("nan"),
                rtf_total=sum(r["audio_s"] for r in ok) / wall, wall_s=wall, client_processes=len(cpu),
                client_cpu_s=max(cpu),
                # how long the requests' audio was (random weights end a request at random unless the server's
                # --min-new-token holds them to one length), and the slowest request's: a request with less
                # audio than its time to first audio cannot be faster than real time
                audio_s_min=min((r["audio_s"] for r in ok), default=float("nan")),
                audio_s_p50=float(np.median([r["audio_s"] for r in ok])) if ok else float("nan"),
                slowest_audio_s=min(ok, key=lambda r: r["rtf"])["audio_s"] if ok else float("nan"), **traced)


def format_table(rows: list[dict]) -> str:
    lines = ["| streams | requests | first audio p50 ms | p99 ms | chunk gap p99 ms | RTF min | RTF p50 | RTF total "
             "| failures |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['streams']} | {r['requests']} | {r['ttfa_p50_ms']:.1f} | {r['ttfa_p99_ms']:.1f} | "
                     f"{r['gap_p99_ms']:.1f} | {r['rtf_min']:.2f} | {r['rtf_p50']:.2f} | {r['rtf_total']:.1f} | "
                     f"{r['failures']} |")
    return "\n".join(lines)


def run_and_report(cfg: ServeBenchConfig) -> dict:
    warm = replace(cfg, requests_per_stream=1)
    for n in sorted({1, min(8, max(cfg.streams))}):  # untimed: connections, and whatever the server warms lazily
        check_warm_up(_level(warm, n), cfg.url)
    rows = [_measured_level(cfg, n) for n in cfg.streams]
    report = {"config": asdict(cfg), "rows": rows}
    print(f"server {cfg.url}, pcm streaming, {cfg.requests_per_stream} request(s) per client")
    print(format_table(rows))
    means = [(r["streams"], r["server_mean_ms"]) for r in rows if r.get("server_mean_ms")]
    if means:
        print(f"server side, mean ms ({MEANS_LEGEND}): "
              + "; ".join(f"{n} streams: {format_means(m)}" for n, m in means))
    for r in rows:
        if line := format_engine(r):
            print(f"at {r['streams']} streams: {line}")
    for r in rows:
        if r["failures"]:
            print(f"warning: at {r['streams']} streams {r['failures']} of {r['requests']} requests failed: "
                  f"{_why(r)}")
        if r["failures"] < r["requests"] and r["client_cpu_s"] > CLIENT_BOUND * r["wall_s"]:
            print(f"warning: at {r['streams']} streams a client process was busy {r['client_cpu_s']:.1f} s of "
                  f"{r['wall_s']:.1f} s: the client may be the bottleneck, and the numbers understate the server "
                  "(lower --streams-per-process)")
    if cfg.json_path:
        with open(cfg.json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if cfg.plot_path:
        _plot(rows, cfg.plot_path)
    return report


def _measured_level(cfg: ServeBenchConfig, n: int) -> dict:
    """A level with what the server showed of it (``Readings.fields``: the engine thread's time by part, its
    steps and windows, the server's means on the way to first audio, this machine's GPUs for a server here),
    from its clients' start on."""
    with Readings(cfg.url) as server:
        row = _level(cfg, n, server.start)
    return dict(row, **server.fields())


def check_warm_up(row: dict, url: str) -> None:
    """Stop a bench whose untimed warm-up got no request through (no server there, a wrong key, an engine that
    is gone): its levels would only count failures."""
    if row["failures"] < row["requests"]:
        return
    raise ValueError(f"no speech request to {url} succeeded ({row['failures']} tried): {_why(row)}")


def _why(row: dict) -> str:
    """A level's first error, or the HTTP statuses of its failed requests."""
    if row["errors"]:
        return row["errors"][0]
    refused = [s for s in row["statuses"] if s != "200"]
    return f"HTTP status {', '.join(refused)}" if refused else "a response without audio"


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["streams"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(n, [r["ttfa_p50_ms"] for r in rows], "o-", label="p50")
    a.plot(n, [r["ttfa_p99_ms"] for r in rows], "o-", label="p99")
    a.set(xscale="log", xlabel="concurrent streams", ylabel="time to first audio (ms)")
    a.legend()
    b.plot(n, [r["rtf_min"] for r in rows], "o-", label="slowest stream")
    b.plot(n, [r["rtf_p50"] for r in rows], "o-", label="median stream")
    b.axhline(1, color="grey", lw=0.8)
    b.set(xscale="log", xlabel="concurrent streams", ylabel="real-time factor")
    b.legend()
    fig.tight_layout()
    fig.savefig(path)
