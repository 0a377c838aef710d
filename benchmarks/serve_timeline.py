"""Where a loaded server's time goes, without HTTP: N threads each stream R requests one after another through
``Pipeline.stream_joined`` (what a server request runs: the text split into sentences, up to 4 in flight),
on full-size random weights, while the engine's steps and the audio rounds are timed on the engine thread.

    python benchmarks/serve_timeline.py --streams 8 64 256 --requests 2 --tokens 500
    python benchmarks/serve_timeline.py --http ...           # the same engine served over HTTP, driven by `bench serve`
    python benchmarks/serve_timeline.py --http --split ...   # the HTTP front in a process of its own
    python benchmarks/serve_timeline.py --http --rates 20 80 --duration 10 --tokens 250 --min-new-token 250
                                                             # open loop: `bench serve --rates`, one rate a level

Per level: wall time, audio seconds per second, first audio p50/p99, and the engine thread's time split into
scheduler steps (prefill steps, decode windows), audio rounds and waiting, with the rounds' decode calls, windows
per call and distinct window lengths per round.

With ``--http``: ``build_app`` over a ``LocalClient``, timed at public seams: an ``Admission`` notes when the
handler admits a request, an ``EngineClient`` wrapper when ``start`` returned (prepared, on the event loop),
``Streams.response`` when the response is built, its ``body_iterator`` the encoded bytes (a request queued for
a running slot waits inside it). ``--split``: an ``EngineHost`` here, a ``RemoteClient`` front in a spawned
process (its HTTP phases not reported)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextvars import ContextVar

import numpy as np

from chattts_velocity.bench.serve import TEXT
from chattts_velocity.bench.stream import StreamBenchConfig, load_bench_chat
from chattts_velocity.constants import SAMPLE_RATE
from chattts_velocity.gc_freeze import freeze_long_lived
from chattts_velocity.server import ServerConfig, build_app
from chattts_velocity.server.admission import Admission
from chattts_velocity.serving.client import EngineClient
from chattts_velocity.serving.engine_process.host import EngineHost
from chattts_velocity.serving.engine_process.messages import FrontEnds, open_pipes
from chattts_velocity.serving.engine_process.remote import RemoteClient
from chattts_velocity.serving.load import warm_up
from chattts_velocity.serving.local import LocalClient


def instrument(chat):
    llm, pump = chat.engine.engine, chat.pipeline.pump
    log = LOG_ENGINE
    step, wake, decode = llm.step, pump.wake, pump.decode
    windows = [0]
    parts = {"schedule": [0.0], "launch": [0.0], "launch_next": [0.0], "collect": [0.0], "output": [0.0]}
    owners = {"schedule": llm.scheduler, "launch": llm.runner, "launch_next": llm.runner, "collect": llm.runner,
              "output": llm}
    log["parts"] = parts

    def timer(name, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                parts[name][0] += time.perf_counter() - t0
        return timed

    for name, owner in owners.items():
        attr = "_output" if name == "output" else name
        setattr(owner, attr, timer(name, getattr(owner, attr)))
    launch, launch_next, open_ = llm.runner.launch, llm.runner.launch_next, llm.runner.open

    def counted_launch(plan):
        windows[0] += plan.decode
        return launch(plan)

    def counted_open(plan, lead):
        windows[0] += plan.decode
        return open_(plan, lead)

    def counted_next(window, num_steps, **kw):
        windows[0] += 1
        return launch_next(window, num_steps, **kw)

    def timed_step():
        waiting, running = len(llm.scheduler.waiting), len(llm.scheduler.running)
        window_before, launched = llm._window is not None, windows[0]
        prompt_tokens = llm._totals["num_prompt_tokens"]
        t0 = time.perf_counter()
        out = step()
        log["steps"].append((t0, time.perf_counter(), len(out), waiting, running,
                             window_before or windows[0] > launched, llm._totals["num_prompt_tokens"] - prompt_tokens))
        return out

    def timed_wake(**kw):
        t0 = time.perf_counter()
        wake(**kw)
        if threading.current_thread().name.startswith("chattts-velocity-engine"):
            log["wakes"].append((t0, time.perf_counter()))

    def timed_decode(windows, use_decoder):
        t0 = time.perf_counter()
        out = decode(windows, use_decoder)
        lengths = sorted({w.length for w in windows})
        log["decodes"].append((t0, time.perf_counter(), len(windows), lengths))
        return out

    to_wavs = pump.audio.to_wavs
    log["to_wavs"] = []

    def timed_to_wavs(results, *args, **kw):
        t0 = time.perf_counter()
        out = to_wavs(results, *args, **kw)
        log["to_wavs"].append((len(results), results[0].shape[0] if results else 0, time.perf_counter() - t0))
        return out

    pump.audio.to_wavs = timed_to_wavs
    llm.step, pump.wake, pump.decode = timed_step, timed_wake, timed_decode
    llm.runner.launch, llm.runner.launch_next, llm.runner.open = counted_launch, counted_next, counted_open
    return log


def reset(log) -> None:
    for key, v in log.items():
        if key == "parts":
            for cell in v.values():
                cell[0] = 0.0
        else:
            v.clear()


def reset_http(log) -> float:
    """Clear the engine's and the HTTP phases' logs for a level over HTTP; its start (``time.monotonic``)."""
    reset(log)
    for spans in LOG_HTTP.values():
        spans.clear()
    return time.monotonic()


def busy_wall(log) -> float:
    """The engine thread's busy span over the level: first step or round to the last (the clients' start-up
    left out); 0 if it did nothing (every request failed before the engine: the level's row says how)."""
    spans = log["steps"] + log["wakes"]
    return max(b for _, b, *_ in spans) - min(a for a, *_ in spans) if spans else 0.0


def level_http(chat, log, url: str, streams: int, requests: int, clients: int = 1, events: bool = False) -> dict:
    """The same load over HTTP: ``chattts-velocity bench serve`` (a process of its own, which splits the streams
    over ``clients`` client processes started together) against the server that runs in this process on the
    instrumented engine."""
    begin, phases = reset_http(log), LOG_HTTP
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        child, own = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        stamps = LOG_STAMPS
        stamps.clear()
        subprocess.run([sys.executable, "-m", "chattts_velocity.cli", "bench", "serve", "--url", url, "--streams",
                        str(streams), "--requests-per-stream", str(requests), "--streams-per-process",
                        str(-(-streams // clients)), "--trace", "--json", f.name], check=True, stdout=subprocess.DEVNULL)
        child_after, own_after = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        (row,) = json.load(open(f.name))["rows"]
    wall = busy_wall(log)
    return {"streams": streams, "requests": row["requests"], "errors": row["failures"],
            "client_rtf_total": round(row["rtf_total"], 1), "first_audio_p50_ms": round(row["ttfa_p50_ms"], 1),
            "first_audio_p99_ms": round(row["ttfa_p99_ms"], 1), "client_headers_p50_ms": round(row["headers_p50_ms"], 1),
            "client_headers_p99_ms": round(row["headers_p99_ms"], 1), "client_processes": row["client_processes"],
            "busiest_client_cpu_s": round(row["client_cpu_s"], 2), "client_level_wall_s": round(row["wall_s"], 2),
            "client_processes_cpu_s (start-up included)": round(
                child_after.ru_utime + child_after.ru_stime - child.ru_utime - child.ru_stime, 2),
            "server_process_cpu_s": round(own_after.ru_utime + own_after.ru_stime - own.ru_utime - own.ru_stime, 2),
            **engine_thread(log, wall), "request_phases": request_phases(chat, phases, begin, wall),
            "http_phases": http_phases(row["traced"], stamps), **(raw_events(chat, log, begin) if events else {})}


def level_open_loop(chat, log, url: str, rate: float, duration: float, events: bool = False) -> dict:
    """Open loop over HTTP: ``chattts-velocity bench serve --rates RATE`` (Poisson arrivals for ``duration`` s)
    against the instrumented server; the client's first audio, the engine thread's time and each request's way
    to its first token and first audio, server side."""
    begin = reset_http(log)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "chattts_velocity.cli", "bench", "serve", "--url", url, "--rates",
                        str(rate), "--duration", str(duration), "--json", f.name], check=True,
                       stdout=subprocess.DEVNULL)
        (row,) = json.load(open(f.name))["rows"]
    wall = busy_wall(log)
    keep = ("rate", "achieved_rate", "first_audio_p50_ms", "first_audio_p95_ms", "first_audio_p99_ms",
            "underruns", "arrivals", "failed")
    return {**{k: row.get(k) for k in keep}, **engine_thread(log, wall),
            "request_phases": request_phases(chat, LOG_HTTP, begin, wall),
            **(raw_events(chat, log, begin) if events else {})}


def raw_events(chat, log, begin: float) -> dict:
    """The level's engine-thread events and per-request milestones (seconds from the level's start), to follow
    one slow request through the steps and audio rounds around it."""
    def rel(t):
        return None if t is None else round(t - begin, 5)

    return {"events": {
        "steps (start, end, outputs, waiting, running, window, prompt tokens)":
            [(rel(a), rel(b), n, wt, r, w, pt) for a, b, n, wt, r, w, pt in log["steps"] if b >= begin],
        "rounds (start, end)": [(rel(a), rel(b)) for a, b in log["wakes"] if b >= begin],
        "decodes (start, end, windows, lengths)": [(rel(a), rel(b), n, ls) for a, b, n, ls in log["decodes"]
                                                   if b >= begin],
        "requests (id, queued, first token, first audio, finished)": [
            (rid, rel(t.queued), rel(t.first_token), rel(t.first_audio), rel(t.finished))
            for rid, t in chat.engine.stats().requests.items() if t.queued >= begin]}}


def http_phases(requests: list[dict], stamps: dict) -> dict:
    """Each request's way from the client's send to its first audio, client times (``bench serve --trace``)
    joined with this server's (one process only; one clock: ``time.monotonic``), p50 / p90 / p99 ms, for the
    clients' first requests and for their later ones."""
    spans: dict[str, dict[str, list[float]]] = {}
    for r in requests:
        st = stamps.get(r["id"], {})
        if not {"app", "handler_in", "handler_out", "start", "body"} <= st.keys():
            continue
        sent = r["sent"]
        parts = {
            "client send -> server app called": st["app"] - sent,
            "app called -> admitted (body read, validation)": st["handler_in"] - st["app"],
            "admitted -> response built (prepare, start)": st["handler_out"] - st["handler_in"],
            "response built -> headers sent": st["start"] - st["handler_out"],
            "headers sent -> client has headers": sent + r["head"] - st["start"],
            "headers sent -> first audio sent": st["body"] - st["start"],
            "first audio sent -> client has it": sent + r["ttfa"] - st["body"],
            "client first audio": r["ttfa"],
        }
        wave = "first" if r["nth"] == 0 else "later"
        for name, v in parts.items():
            spans.setdefault(wave, {}).setdefault(name, []).append(v)
    return {wave: {name: [round(1e3 * float(np.percentile(xs, q)), 1) for q in (50, 90, 99)] + [len(xs)]
                   for name, xs in parts.items()} for wave, parts in spans.items()}


def request_phases(chat, phases, begin: float, wall: float) -> dict:
    """Where an HTTP request's time goes, server side: per phase the p50/p90 seconds and the mean number of
    requests in it (its total time over the wall time: Little's law). Engine phases are per sentence."""
    engine = [t for t in chat.engine.stats().requests.values() if t.queued >= begin and t.finished]
    spans = {
        "handler: admitted -> response built": [b - a for a, b in phases["handler"]],
        "prepare: admitted -> client.start returned": [b - a for a, b in phases["prepare"]],
        "body: first next -> last bytes": [b - a for a, b in phases["body"]],
        "body: first next -> first bytes out": [b - a for a, b in phases["first_chunk"]],
        "event loop lag (10 ms sleeps)": [lag for t, lag in phases["loop_lag"] if t >= begin],
        "engine: queued -> first token": [t.first_token - t.queued for t in engine if t.first_token],
        "engine: first token -> first audio": [t.first_audio - t.first_token for t in engine
                                               if t.first_token and t.first_audio],
        "engine: first token -> finished": [t.finished - t.first_token for t in engine if t.first_token],
    }
    spans.update(engine_paths(engine, begin))
    out = {}
    for name, xs in spans.items():
        if xs:
            out[name] = {"n": len(xs), "p50_s": round(float(np.median(xs)), 3),
                         "p90_s": round(float(np.percentile(xs, 90)), 3), "p99_s": round(float(np.percentile(xs, 99)), 3),
                         "mean_in_phase": round(sum(xs) / wall, 1)}
    return out


def engine_paths(engine_times, begin: float) -> dict:
    """What the engine thread did between each request's arrival and first token, and between its first token
    and first audio: seconds in decode windows, in other steps (prompts), in audio rounds, elsewhere (between
    them: the loop, the GIL), and how many steps it started in between (``engine_times``: ``RequestTimes``)."""
    log = LOG_ENGINE
    kinds = {"in windows": [(a, b) for a, b, _, _, _, w, _ in log["steps"] if w and b >= begin],
             "in other steps": [(a, b) for a, b, _, _, _, w, _ in log["steps"] if not w and b >= begin],
             "in audio rounds": [(a, b) for a, b in log["wakes"] if b >= begin]}
    starts = sorted(a for a, *_ in log["steps"])

    def overlap(spans, lo, hi):
        return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans if b > lo and a < hi)

    out = {}
    for path, ends in (("queued -> first token", ("queued", "first_token")),
                       ("first token -> first audio", ("first_token", "first_audio"))):
        for t in engine_times:
            lo, hi = getattr(t, ends[0]), getattr(t, ends[1])
            if lo is None or hi is None:
                continue
            rest = hi - lo
            for kind, spans in kinds.items():
                part = overlap(spans, lo, hi)
                out.setdefault(f"{path}: {kind}", []).append(part)
                rest -= part
            out.setdefault(f"{path}: elsewhere", []).append(max(0.0, rest))
            out.setdefault(f"{path}: steps started (count)", []).append(sum(1 for a in starts if lo < a < hi))
    return out


def level(chat, log, streams: int, requests: int, tokens: int) -> dict:
    reset(log)
    texts = chat.prepare_texts(TEXT, True, None, True, True)
    spk = chat.sample_random_speaker()
    firsts, audio_s, errors = [], [], []
    lock = threading.Lock()

    def client(i: int) -> None:
        for r in range(requests):
            p = chat.InferCodeParams(spk_emb=spk, manual_seed=1000 * i + r, max_new_token=tokens,
                                     min_new_token=tokens, show_tqdm=False)
            start, first, n = time.perf_counter(), None, 0
            try:
                for chunk in chat.pipeline.stream_joined(texts, p, use_decoder=True, in_flight=4):
                    if first is None:
                        first = time.perf_counter() - start
                    n += chunk.size
            except Exception as e:  # noqa: BLE001 - counted
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                firsts.append(first)
                audio_s.append(n / SAMPLE_RATE)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "streams": streams, "requests": len(firsts), "errors": len(errors), "wall_s": round(wall, 3),
        "audio_s_per_s": round(sum(audio_s) / wall, 1),
        "first_audio_p50_ms": round(1e3 * float(np.median(firsts)), 1) if firsts else None,
        "first_audio_p99_ms": round(1e3 * float(np.percentile(firsts, 99)), 1) if firsts else None,
        **engine_thread(log, wall), "first_errors": errors[:2],
    }


def engine_thread(log, wall: float) -> dict:
    """The engine thread's time over ``wall`` seconds: steps, audio rounds, idle; decode calls and batches."""
    steps, wakes, decodes = log["steps"], log["wakes"], log["decodes"]
    step_s = sum(b - a for a, b, *_ in steps)
    window_s = sum(b - a for a, b, _, _, _, w, _ in steps if w)
    slow = sorted(((b - a, w, n, wt, r, pt) for a, b, n, wt, r, w, pt in steps if not w), reverse=True)[:6]
    wake_s = sum(b - a for a, b in wakes)
    decode_s = sum(b - a for a, b, _, _ in decodes)
    rounds_with_decode = len({round(a, 6) for a, *_ in decodes})
    return {
        "wall_s": round(wall, 3), "engine_steps": len(steps), "engine_step_s": round(step_s, 3), "of_which_windows_s": round(window_s, 3),
        "audio_round_s": round(wake_s, 3), "engine_thread_idle_s": round(wall - step_s - wake_s, 3),
        "decode_calls": len(decodes), "decode_s": round(decode_s, 3),
        "decode_ms_per_call": round(1e3 * decode_s / max(len(decodes), 1), 2),
        "windows_per_call": round(sum(n for _, _, n, _ in decodes) / max(len(decodes), 1), 1),
        "distinct_lengths_per_call_set": round(np.mean([len(ls) for *_, ls in decodes]), 2) if decodes else 0,
        "rounds_with_decode": rounds_with_decode,
        "mean_batch": round(float(np.mean([r for *_, r, _, _ in steps])), 1) if steps else 0,
        "to_wavs_calls": len(log["to_wavs"]),
        "to_wavs_s": round(sum(t for *_, t in log["to_wavs"]), 3),
        "to_wavs_ms_p50_by_batch (<=8, <=32, >32)": [
            round(1e3 * float(np.median(ts)), 2) if (ts := [t for b, _, t in log["to_wavs"] if lo < b <= hi]) else None
            for lo, hi in ((0, 8), (8, 32), (32, 10**9))],
        "step_parts_s": {k: round(v[0], 3) for k, v in log["parts"].items()},
        "slowest_other_steps (s, window, outputs, waiting, running, prompt tokens)":
            [(round(d, 4), w, n, wt, r, pt) for d, w, n, wt, r, pt in slow],
    }


LOG_ENGINE = {"steps": [], "wakes": [], "decodes": []}
LOG_HTTP = {"handler": [], "prepare": [], "body": [], "first_chunk": [], "loop_lag": []}
LOG_STAMPS: dict[str, dict[str, float]] = {}
"""X-Request-Id -> when (``time.monotonic``) the app was called, the request admitted, its response built, the
headers and the first audio sent."""
REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)  # set by StampApp, on the task
ADMITTED: ContextVar[float | None] = ContextVar("admitted", default=None)  # set by TimedAdmission


def stamp(**times: float) -> None:
    rid = REQUEST_ID.get()
    if rid is not None:
        LOG_STAMPS.setdefault(rid, {}).update(times)


class StampApp:
    """ASGI wrapper: notes when a request with an ``X-Request-Id`` reaches the app and when its headers and its
    first body bytes are handed to the server; the handler (same task) sees the id in ``REQUEST_ID``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        rid = dict(scope.get("headers") or []).get(b"x-request-id") if scope["type"] == "http" else None
        if rid is None:
            return await self.app(scope, receive, send)
        REQUEST_ID.set(rid.decode())
        st = LOG_STAMPS.setdefault(rid.decode(), {})
        st["app"] = time.monotonic()

        async def stamped(message):
            if message["type"] == "http.response.start":
                st["start"] = time.monotonic()
            elif message["type"] == "http.response.body" and message.get("body") and "body" not in st:
                st["body"] = time.monotonic()
            await send(message)

        return await self.app(scope, receive, stamped)


async def lag_monitor() -> None:
    """How late the event loop runs a 10 ms sleep's wake-up."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.01)
        LOG_HTTP["loop_lag"].append((t, time.monotonic() - t - 0.01))


class TimedAdmission(Admission):
    """Notes when the handler admits a request (its first step after validation); starts ``lag_monitor``."""

    monitor: asyncio.Task | None = None

    def admit(self):
        if TimedAdmission.monitor is None:
            TimedAdmission.monitor = asyncio.get_running_loop().create_task(lag_monitor())
        t = time.monotonic()
        ADMITTED.set(t)
        stamp(handler_in=t)
        return super().admit()


class TimedClient:
    """``client`` as it is (every other name passed through), noting when ``start`` returned (prepared)."""

    def __init__(self, client: EngineClient):
        self.client = client

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def start(self, prompts, params, in_flight: int):
        audio = self.client.start(prompts, params, in_flight)
        LOG_HTTP["prepare"].append((ADMITTED.get(), time.monotonic()))
        return audio


def timed_app(chat, config: ServerConfig):
    """The speech app over ``chat`` (``LocalClient``) with the handler's steps and the bodies timed: the
    admission, ``start`` and the public ``Streams.response`` wrapped, the body's bytes iterator with it."""
    app = build_app(TimedClient(LocalClient(chat)), config, TimedAdmission(config.max_concurrent, config.max_queue))
    streams = app.state.speech.streams
    response = streams.response

    def timed_response(*args):
        out = response(*args)
        t0, t1 = ADMITTED.get(), time.monotonic()
        LOG_HTTP["handler"].append((t0, t1))
        stamp(handler_out=t1)
        out.body_iterator = timed_body(out.body_iterator)
        return out

    streams.response = timed_response
    return StampApp(app)


async def timed_body(body):
    """``body``'s bytes, timed from the first ``next`` (the response started) to the first bytes and to the end."""
    t0, first = time.monotonic(), True
    try:
        async for data in body:
            if first:
                LOG_HTTP["first_chunk"].append((t0, time.monotonic()))
                first = False
            yield data
    finally:
        LOG_HTTP["body"].append((t0, time.monotonic()))
        await body.aclose()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(chat, config: ServerConfig) -> str:
    """The speech server over ``chat`` on a free loopback port, on a thread of this process; its URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(timed_app(chat, config), host="127.0.0.1", port=port,
                                           log_level="warning", timeout_keep_alive=config.keep_alive_s))
    threading.Thread(target=server.run, name="uvicorn", daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}"


def front_main(ends: FrontEnds, config: ServerConfig, port: int) -> None:
    """The HTTP front of ``start_split_server``, in a process of its own (as ``run.serve_fronts``' fronts)."""
    import uvicorn

    client = RemoteClient(ends, beat_timeout_s=config.engine_timeout_s)
    client.wait_ready()
    app = build_app(client, config)
    freeze_long_lived()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=config.keep_alive_s)


def start_split_server(chat, config: ServerConfig) -> str:
    """``serve --engine-process`` turned around: the engine is served from this process (instrumented; an
    ``EngineHost`` over ``LocalClient``, as the engine process serves it), the HTTP front (a ``RemoteClient``)
    runs in a spawned process; its URL. The HTTP phases are the front's, so only the engine's are reported."""
    import httpx

    ctx = mp.get_context("spawn")
    engine_ends, front_ends = open_pipes(1, ctx)
    port = free_port()
    ctx.Process(target=front_main, args=(front_ends[0], config, port), daemon=True).start()
    front_ends[0].close()  # the front's now: when it exits, the host sees its pipes close
    host = EngineHost(LocalClient(chat), engine_ends)
    host.announce()
    host.start_beating()  # without beats the front takes the engine for hung and answers 503 (``--engine-timeout``)
    threading.Thread(target=host.serve, name="host", daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the split server did not start")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--round-interval", type=float, nargs="+", default=None,
                    help="AudioPump.round_interval_s values to compare, each over every level (default: as loaded)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1],
                    help="with --http: client processes the bench splits the load over (several values: each compared)")
    ap.add_argument("--http", action="store_true",
                    help="serve the engine over HTTP in this process and drive it with `bench serve` instead")
    ap.add_argument("--max-window-tokens", type=int, default=None,
                    help="the engine's max_window_tokens (default: none, as Chat.load)")
    ap.add_argument("--split", action="store_true",
                    help="with --http: the engine served from this process, the HTTP front in a process of its own "
                         "(as `serve --engine-process`)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval of this process (the engine's; default: Python's 5 ms)")
    ap.add_argument("--min-new-token", type=int, default=0,
                    help="with --http: the server's min_new_token (--tokens: every request as long; the in-process "
                         "levels always are)")
    ap.add_argument("--rates", type=float, nargs="+", default=None,
                    help="with --http: open loop instead of --streams, one level per rate (req/s) for --duration s")
    ap.add_argument("--duration", type=float, default=10.0, help="with --rates: seconds of arrivals per rate")
    ap.add_argument("--open-window-max-seqs", type=int, nargs="+", default=None,
                    help="EngineConfig.open_window_max_seqs values to compare, each over every level")
    ap.add_argument("--events", action="store_true",
                    help="with --http: keep each level's raw engine-thread events and request milestones in the JSON")
    args = ap.parse_args()
    if args.rates and not args.http:
        ap.error("--rates drives the server over HTTP: add --http")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    chat = load_bench_chat(StreamBenchConfig(size=args.size), max(args.streams) * 4)
    chat.engine.engine.scheduler.max_window_tokens = args.max_window_tokens
    log = instrument(chat)
    if args.http:  # what `serve` runs before it listens (the window-decode graphs, the engine's shapes)
        t0 = time.perf_counter()
        warm_up(chat)
        print(f"server warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    level(chat, log, 2, 1, 64)  # warm-up
    if args.http:
        config = ServerConfig(max_concurrent=max(args.streams), max_queue=max(4 * max(args.streams), 1024),
                              max_new_token=args.tokens, min_new_token=args.min_new_token)
        url = (start_split_server if args.split else start_server)(chat, config)
    rows = []
    llm = chat.engine.engine
    for open_max in args.open_window_max_seqs or [llm.config.open_window_max_seqs]:
        llm.config = dataclasses.replace(llm.config, open_window_max_seqs=open_max)
        for interval in args.round_interval or [chat.pipeline.pump.round_interval_s]:
            chat.pipeline.pump.round_interval_s = interval
            for clients in args.clients if args.http else [1]:
                for n in (args.rates if args.http and args.rates else args.streams):
                    if args.http and args.rates:
                        row = level_open_loop(chat, log, url, n, args.duration, args.events)
                    elif args.http:
                        row = level_http(chat, log, url, n, args.requests, clients, args.events)
                    else:
                        row = level(chat, log, n, args.requests, args.tokens)
                    row = {"open_window_max_seqs": open_max, "round_interval_s": interval, **row}
                    print(json.dumps({k: v for k, v in row.items() if k != "events"}), flush=True)
                    rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    chat.unload()


if __name__ == "__main__":
    main()
