"""``chattts-velocity bench serve --realtime``: drive a running speech server's realtime WebSocket
(``/v1/audio/speech/stream``) as voice agents do. Per level, S sockets with one context each, all started together;
each context's text is appended word by word at an LLM's pace, sentence ends included, then ended; a fraction of
the contexts is interrupted (``context.cancel``) at its first audio. Per level: time from the first sentence's end
to its first audio (p50/p95/p99), playback underruns, cancel to ``context.cancelled`` and to the last audio, audio
after ``context.cancelled`` (must be 0) and, in a probe after the level, cancel to KV blocks free. JSON and a
markdown table; a large level is split over client processes as ``bench serve`` splits it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, replace

import numpy as np

from .realtime_client import (
    RealtimeBenchConfig,
    barged,
    kv_probe,
    open_socket,
    require_websockets,
    run_context,
    settled_blocks,
    ws_url,
)
from .report import prepare_output, write_json
from .serve import CLIENT_BOUND, run_client_processes

DEFINITIONS = {
    "first_audio_*_ms": "per context: from the moment the append holding the first sentence's end was sent until "
                        "its first audio.delta arrived; percentiles over the level's contexts that finished",
    "underruns": "contexts whose playback, started at their first audio byte, would have waited for later audio "
                 "(an audio.delta arriving after the samples before it had played); a barged context counts "
                 "until its cancel. Text written slower than it is spoken underruns by itself",
    "cancel_to_cancelled_*_ms": "context.cancel sent -> context.cancelled received, barged contexts",
    "cancel_to_last_audio_*_ms": "context.cancel sent -> the context's last audio.delta received (0 if none came "
                                 "after the cancel)",
    "audio_after_cancelled": "audio.delta frames of a context received after its context.cancelled (must be 0)",
    "kv_free_ms": "probe after the level: K contexts (K = the level's barge-ins) on sockets of their own, each with "
                  "a text of at least 8 sentences appended at once and not ended, cancelled all at once when each "
                  "has its first audio; from the last cancel sent until GET /metrics first shows "
                  "chattts_kv_blocks_used back at kv_blocks_before_probe (read every 20 ms: the blocks were freed "
                  "after kv_free_after_ms, the last read that still showed them, and before kv_free_ms)",
    "kv_blocks_held": "chattts_kv_blocks_used just before the probe's cancels",
    "kv_blocks_before, kv_blocks_after": "chattts_kv_blocks_used before the level and after its probe, once back "
                                         "at 0 (or after kv_timeout_s)",
}


async def _sockets(cfg: RealtimeBenchConfig, ids: range, n: int, barrier=None) -> tuple[list[dict], float, float]:
    """Sockets ``ids`` of a level of ``n``: all opened first (then ``barrier``, if any, is waited for), then their
    contexts run together. Every result, and the ``perf_counter`` and ``process_time`` when they started."""
    opened = await asyncio.gather(*(open_socket(cfg, i) for i in ids), return_exceptions=True)
    if barrier is not None:
        await asyncio.to_thread(barrier.wait)
    start, cpu = time.perf_counter(), time.process_time()

    async def one(i: int, ws) -> dict:
        if isinstance(ws, BaseException):
            return {"ok": False, "barged": False, "cancel_sent": False,
                    "error": f"{type(ws).__name__} on connect: {ws!r}"[:300]}
        return await run_context(ws, cfg, barged(i, n, cfg.barge_in))

    return list(await asyncio.gather(*(one(i, ws) for i, ws in zip(ids, opened, strict=True)))), start, cpu


def _client_process(cfg: RealtimeBenchConfig, ids: range, n: int, barrier, out) -> None:
    results, _, cpu = asyncio.run(_sockets(cfg, ids, n, barrier))
    out.put((results, time.process_time() - cpu))


def run_level(cfg: RealtimeBenchConfig, n: int) -> tuple[list[dict], float, list[float]]:
    """``n`` sockets at once, in this process or split over several: every context's result, the level's wall
    time and each client process's CPU time."""
    procs = -(-n // cfg.streams_per_process)
    if procs == 1:
        results, start, cpu = asyncio.run(_sockets(cfg, range(n), n))
        return results, time.perf_counter() - start, [time.process_time() - cpu]
    bounds = [n * i // procs for i in range(procs + 1)]
    parts, wall = run_client_processes(_client_process, [(cfg, range(bounds[i], bounds[i + 1]), n)
                                                         for i in range(procs)], cfg.timeout_s + 60)
    return [r for results, _ in parts for r in results], wall, [cpu for _, cpu in parts]


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) * 1e3 if xs else None


def summary(n: int, results: list[dict], wall: float, cpu: list[float]) -> dict:
    """One level's row from its contexts' results."""
    ok = [r for r in results if r["ok"]]
    first = [r["first_audio_s"] for r in ok if r["first_audio_s"] is not None]
    cut = [r for r in ok if r["cancel_sent"] and r["cancelled_s"] is not None]
    return dict(
        streams=n, contexts=len(results), failures=len(results) - len(ok),
        errors=[r["error"] for r in results if r.get("error")][:5],
        first_audio_p50_ms=_pct(first, 50), first_audio_p95_ms=_pct(first, 95), first_audio_p99_ms=_pct(first, 99),
        underruns=sum(bool(r["underrun"]) for r in ok),
        audio_s_p50=float(np.median([r["audio_s"] for r in ok])) if ok else None,
        # the audio received against what audio.done says was sent (contexts that were not cut)
        usage_mismatches=sum(abs(r["audio_s"] - (r["usage_audio_s"] or 0)) > 1e-3
                             for r in ok if not r["cancel_sent"]),
        segments=sum(r["segments"] for r in ok),
        barge_ins=sum(r["cancel_sent"] for r in results), cancelled=len(cut),
        cancel_to_cancelled_p50_ms=_pct([r["cancelled_s"] for r in cut], 50),
        cancel_to_cancelled_p95_ms=_pct([r["cancelled_s"] for r in cut], 95),
        cancel_to_last_audio_p50_ms=_pct([r["last_audio_s"] for r in cut], 50),
        cancel_to_last_audio_p95_ms=_pct([r["last_audio_s"] for r in cut], 95),
        audio_after_cancelled=sum(r.get("after_cancelled", 0) for r in results),
        audio_s_per_s=sum(r["audio_s"] for r in ok) / wall, wall_s=wall, client_processes=len(cpu),
        client_cpu_s=max(cpu))


def _cell(value, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: list[dict]) -> str:
    lines = ["| sockets | first audio p50 ms | p95 ms | p99 ms | underruns | barge-ins | cancel→cancelled p95 ms "
             "| cancel→last audio p95 ms | audio after cancelled | cancel→KV free ms | failures |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['streams']} | {_cell(r['first_audio_p50_ms'])} | {_cell(r['first_audio_p95_ms'])} | "
                     f"{_cell(r['first_audio_p99_ms'])} | {r['underruns']} | {r['barge_ins']} | "
                     f"{_cell(r['cancel_to_cancelled_p95_ms'])} | {_cell(r['cancel_to_last_audio_p95_ms'])} | "
                     f"{r['audio_after_cancelled']} | {_cell(r.get('kv_free_ms'), '.0f')} | {r['failures']} |")
    return "\n".join(lines)


def level(cfg: RealtimeBenchConfig, n: int) -> dict:
    """One level's row: its contexts, then (with barge-ins) the KV probe, and the blocks in use around it."""
    before = asyncio.run(settled_blocks(cfg))
    row = summary(n, *run_level(cfg, n))
    if row["barge_ins"]:
        try:
            row.update(asyncio.run(kv_probe(cfg, row["barge_ins"])))
        except Exception as e:  # noqa: BLE001 - the level's figures stand; the probe's failure is reported
            row.update(kv_free_ms=None, kv_probe_error=f"{type(e).__name__}: {e!r}"[:300])
    return dict(row, kv_blocks_before=before, kv_blocks_after=asyncio.run(settled_blocks(cfg)))


def run_and_report(cfg: RealtimeBenchConfig) -> dict:
    require_websockets()
    if cfg.json_path:
        prepare_output(cfg.json_path)
    try:
        asyncio.run(settled_blocks(cfg))
    except OSError as e:
        raise ValueError(f"no speech server answers at {cfg.url}: {e}") from None
    n = min(8, max(cfg.streams))  # untimed, in this process: whatever the server warms lazily
    warm = summary(n, *run_level(replace(cfg, streams_per_process=n), n))
    if warm["failures"] == n:
        why = (warm["errors"] or ["no audio"])[0]
        raise ValueError(f"the realtime WebSocket at {ws_url(cfg.url)} failed: {why}")
    rows = [level(cfg, n) for n in cfg.streams]
    config = {k: v for k, v in asdict(cfg).items() if k != "api_key"}  # a results file is shared; a key is not
    report = {"config": config, "definitions": DEFINITIONS, "rows": rows}
    print(f"server {ws_url(cfg.url)}, {cfg.sentences} sentence(s) per context at {cfg.words_per_s:g} words/s, "
          f"barge-in on {cfg.barge_in:.0%} of contexts")
    print(format_table(rows))
    for r in rows:
        if r["client_cpu_s"] > CLIENT_BOUND * r["wall_s"]:
            print(f"warning: at {r['streams']} sockets a client process was busy {r['client_cpu_s']:.1f} s of "
                  f"{r['wall_s']:.1f} s: the numbers may be the client's (lower --streams-per-process)")
    if cfg.json_path:
        write_json(report, cfg.json_path)
    return report
