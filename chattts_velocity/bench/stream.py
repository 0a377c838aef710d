"""``chattts-velocity bench stream``: N concurrent streaming ``Chat.infer`` calls, as N users of one process
would make them (one thread each, all started together), on the velocity path; beside them, in the same run,
upstream-style streaming on the reference path (one batched call of N texts re-decoding the growing audio).

Per stream: time to first audio (call to the first chunk in hand), real-time factor (seconds of audio over
the stream's wall time), whether playback started at the first chunk would ever run dry (an underrun: a
chunk arriving over 1 ms after the audio before it has played, as ``bench serve --rates`` counts them) and the
smallest start delay that never stalls (``DEFINITIONS``)."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from ..audio.stream import StreamConfig
from ..chat import Chat
from ..device import default_engine_dtype, resolve_device
from ..engine import EngineConfig
from ..model.checkpoint import write_checkpoint
from .playback import StreamRecord
from .runner import device_name

TEXT = "Streaming speech for many users at once, chunk by chunk."
DEFINITIONS = {
    "ttfa_*_ms": "first audio: the call -> its first chunk in hand",
    "underruns": "streams whose playback, started at their first chunk, would stall: a chunk arriving over 1 ms "
                 "after the audio before it had played (``bench serve --rates`` counts them so)",
    "start_delay_*_ms": "per stream, the smallest wait after its first chunk before playback that never stalls "
                        "(0 when it never would)",
    "audio_s_per_s": "every stream's audio over the level's wall time",
    "stalls_at_chunk": "of the streams that underrun, how many first stall waiting for chunk N (0-based; summed "
                       "over the runs): 1 is the chunk after the first",
}
@dataclass(frozen=True)
class StreamBenchConfig:
    """One ``bench stream`` run."""

    streams: tuple[int, ...] = (1, 8, 64, 256)
    """Concurrent streams per variant."""
    tokens: int = 500
    """Audio tokens per stream, exactly (EOS masked until then)."""
    size: str = "full"
    """``full`` random weights of the real shapes, or ``tiny``."""
    device: str | None = None
    dtype: str | None = None
    """Engine dtype; None: ``device.default_engine_dtype``."""
    repeats: int = 2
    """Timed runs per variant; every figure is the median over them (underruns: the most)."""
    reference_max_streams: int | None = None
    """Run the reference only up to this many streams; None: every variant."""
    window_stops: tuple[int, ...] = EngineConfig.window_stops
    """``EngineConfig.window_stops`` of the velocity engine."""
    chunk: int = StreamConfig.chunk
    """``StreamConfig.chunk``: most tokens in a later chunk."""
    json_path: str | None = "bench_stream.json"

    def __post_init__(self) -> None:
        if not self.streams or any(not isinstance(n, int) or n < 1 for n in self.streams):
            raise ValueError(f"--streams must be ints >= 1, got {self.streams!r}")
        if not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"--tokens must be an int >= 1, got {self.tokens!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"--repeats must be an int >= 1, got {self.repeats!r}")
        if self.size not in ("full", "tiny"):
            raise ValueError(f"--size must be full or tiny, got {self.size!r}")
        StreamConfig(chunk=self.chunk)  # says what is wrong with it


def load_bench_chat(cfg: StreamBenchConfig, max_streams: int) -> Chat:
    """A ``Chat`` over ``cfg``'s random weights, with room for ``max_streams`` streams."""
    device = resolve_device(cfg.device)
    chat = Chat()
    kw = dict(device=device, engine_dtype=cfg.dtype or default_engine_dtype(device), max_num_seqs=max(max_streams, 1),
              window_stops=cfg.window_stops, stream_config=StreamConfig(chunk=cfg.chunk))
    if cfg.size == "full":
        chat.load(load_format="dummy", **kw)
    else:
        with tempfile.TemporaryDirectory() as root:
            write_checkpoint(root, "tiny", seed=0)
            chat.load(source="custom", custom_path=root, **kw)
    return chat


def _params(chat, tokens: int, seed: int):
    return chat.InferCodeParams(manual_seed=seed, max_new_token=tokens, min_new_token=tokens, show_tqdm=False)


def velocity_streams(chat, n: int, tokens: int) -> list[StreamRecord]:
    """``n`` threads, each streaming its own call; all start together."""
    records = [StreamRecord() for _ in range(n)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        barrier.wait()
        rec, start = records[i], time.perf_counter()
        try:
            for chunk in chat.infer([TEXT], stream=True, skip_refine_text=True, split_text=False,
                                    params_infer_code=_params(chat, tokens, i)):
                rec.arrivals.append(time.perf_counter() - start)
                rec.samples.append(chunk.shape[1])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
        rec.end = time.perf_counter() - start

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed") from errors[0]
    return records


def reference_streams(chat, n: int, tokens: int) -> list[StreamRecord]:
    """Upstream's way: one batched call of ``n`` texts; every row's chunks arrive together."""
    rec, start = StreamRecord(), time.perf_counter()
    for chunk in chat.infer([TEXT] * n, stream=True, use_velocity=False, skip_refine_text=True, split_text=False,
                            params_infer_code=_params(chat, tokens, 0)):
        if chunk.shape[1]:
            rec.arrivals.append(time.perf_counter() - start)
            rec.samples.append(chunk.shape[1])
    rec.end = time.perf_counter() - start
    return [rec] * n


def summarize(records: list[StreamRecord]) -> dict:
    ttfa = [r.arrivals[0] if r.arrivals else float("nan") for r in records]
    delay = [r.start_delay() for r in records]
    rtf = [r.audio_s() / r.end for r in records]
    wall = max(r.end for r in records)
    return dict(
        streams=len(records), ttfa_p50_ms=1e3 * float(np.percentile(ttfa, 50)),
        ttfa_p95_ms=1e3 * float(np.percentile(ttfa, 95)), ttfa_p99_ms=1e3 * float(np.percentile(ttfa, 99)),
        rtf_min=min(rtf), rtf_p50=float(np.median(rtf)), audio_s_per_s=sum(r.audio_s() for r in records) / wall,
        underruns=sum(r.underrun() for r in records), start_delay_p50_ms=1e3 * float(np.percentile(delay, 50)),
        start_delay_p95_ms=1e3 * float(np.percentile(delay, 95)),
        chunks_p50=float(np.median([len(r.arrivals) for r in records])),
        stalls_at_chunk=_by_chunk(Counter(str(c) for r in records if (c := r.stall_chunk()) is not None)),
    )


def _by_chunk(counts: Counter) -> dict[str, int]:
    """Counts by chunk index (a string, as JSON keys are), in the chunks' order."""
    return {c: counts[c] for c in sorted(counts, key=int)}


def _median(runs: list[dict]) -> dict:
    out = {k: float(np.median([r[k] for r in runs])) for k in runs[0] if k != "stalls_at_chunk"}
    out.update(streams=runs[0]["streams"], underruns=max(r["underruns"] for r in runs), repeats=len(runs),
               stalls_at_chunk=_by_chunk(sum((Counter(r["stalls_at_chunk"]) for r in runs), Counter())))
    return out


def run_stream_bench(cfg: StreamBenchConfig) -> dict:
    chat = load_bench_chat(cfg, max(cfg.streams))
    engine_config = chat.engine.engine.config
    device, stops = device_name(chat.device), list(engine_config.window_stops)
    try:
        # warm-up: the wav decode's graphs of every batch bucket (a capture at first use stalls a level's round,
        # as a server's warm-up avoids), kernels, audio shapes
        chat.audio.use_graphs(chat.pipeline.stream_config.window_lengths(), capture=True)
        for n in sorted({1, min(8, max(cfg.streams))}):
            velocity_streams(chat, n, 64)
        rows = []
        for n in cfg.streams:
            runs = [summarize(velocity_streams(chat, n, cfg.tokens)) for _ in range(cfg.repeats)]
            rows.append(dict(path="velocity", **_median(runs)))
            if cfg.reference_max_streams is None or n <= cfg.reference_max_streams:
                runs = [summarize(reference_streams(chat, n, cfg.tokens)) for _ in range(cfg.repeats)]
                rows.append(dict(path="reference", **_median(runs)))
    finally:
        chat.unload()
    return dict(config=asdict(cfg), device=device, window_stops=stops,
                window_stop_budget_ms=engine_config.window_stop_budget_ms,
                window_budget_ms=engine_config.window_budget_ms, definitions=DEFINITIONS, rows=rows)


def format_table(report: dict) -> str:
    lines = ["| streams | path | first audio p50 ms | p95 ms | p99 ms | RTF min | RTF p50 | audio s/s | underruns | "
             "start delay p50 / p95 ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['streams']} | {r['path']} | {r['ttfa_p50_ms']:.1f} | {r['ttfa_p95_ms']:.1f} | "
                     f"{r['ttfa_p99_ms']:.1f} | {r['rtf_min']:.2f} | {r['rtf_p50']:.2f} | {r['audio_s_per_s']:.1f} | "
                     f"{r['underruns']} | {r['start_delay_p50_ms']:.1f} / {r['start_delay_p95_ms']:.1f} |")
    return "\n".join(lines)


def run_and_report(cfg: StreamBenchConfig) -> dict:
    report = run_stream_bench(cfg)
    budget = report["window_stop_budget_ms"]
    later = "" if len(report["window_stops"]) < 2 else (
        " (every one)" if budget is None else f" (after the first while a full window takes over {budget:g} ms)")
    windows = "" if report["window_budget_ms"] is None else f", full windows within {report['window_budget_ms']:g} ms"
    print(f"device: {report['device']}, {cfg.tokens} tokens per stream, median of {cfg.repeats} runs, window stops "
          f"{report['window_stops']}{later}{windows}, later chunks up to {cfg.chunk} tokens")
    print(format_table(report))
    for r in report["rows"]:
        if r["stalls_at_chunk"]:
            stalls = ", ".join(f"chunk {c}: {n}" for c, n in r["stalls_at_chunk"].items())
            print(f"{r['streams']} streams ({r['path']}), first stall at {stalls} (summed over the runs)")
    if cfg.json_path:
        with open(cfg.json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return report
