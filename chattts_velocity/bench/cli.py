"""The ``chattts-velocity bench`` subcommand: its parser and the dispatch to the engine, stream, serve and serve
--realtime modes."""

from __future__ import annotations

import argparse

from .config import DEFAULT_BATCHES, DTYPES, SIZES, BenchConfig
from .realtime import RealtimeBenchConfig
from .realtime import run_and_report as run_realtime
from .runner import run_and_report
from .serve import ServeBenchConfig
from .serve import run_and_report as run_serve
from .stream import StreamBenchConfig
from .stream import run_and_report as run_stream


def bench_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        size=args.size, batches=tuple(args.batch), tokens=args.tokens, device=args.device, dtype=args.dtype,
        json_path=args.json, plot_path=args.plot, skip_reference=args.skip_reference,
        reference_max_batch=args.reference_max_batch, seed=args.seed, repeats=args.repeats,
        decode_batch=args.decode_batch, max_num_seqs=args.max_num_seqs, kv_cache_gib=args.kv_cache_gib,
        prefix_caching=args.prefix_caching, enforce_eager=args.enforce_eager,
        show_progress=not args.no_progress,
    )


def realtime_config(args: argparse.Namespace) -> RealtimeBenchConfig:
    return RealtimeBenchConfig(
        url=args.url.rstrip("/"), streams=tuple(args.streams), words_per_s=args.words_per_s,
        barge_in=args.barge_in, sentences=args.sentences, api_key=args.api_key,
        json_path=args.json if args.json != "bench.json" else "bench_realtime.json",
        streams_per_process=args.streams_per_process,
    )


def _bench(args: argparse.Namespace) -> int:
    if args.realtime and args.mode != "serve":
        raise ValueError("--realtime drives a running server: chattts-velocity bench serve --realtime")
    if args.realtime:
        run_realtime(realtime_config(args))
        return 0
    if args.mode == "serve":
        run_serve(ServeBenchConfig(
            url=args.url.rstrip("/"), streams=tuple(args.streams), requests_per_stream=args.requests_per_stream,
            api_key=args.api_key, json_path=args.json if args.json != "bench.json" else "bench_serve.json",
            plot_path=args.plot, streams_per_process=args.streams_per_process, trace=args.trace,
        ))
        return 0
    if args.mode == "stream":
        run_stream(StreamBenchConfig(
            streams=tuple(args.streams), tokens=args.tokens, size=args.size, device=args.device, dtype=args.dtype,
            repeats=args.repeats if args.repeats > 1 else 2,
            reference_max_streams=0 if args.skip_reference else args.reference_max_batch,
            json_path=args.json if args.json != "bench.json" else "bench_stream.json",
        ))
        return 0
    run_and_report(bench_config(args))
    return 0


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="reference decode vs velocity engine on random weights, in one run",
                       description="Time the reference decode loop and the velocity engine on the same "
                                   "random weights and prompt: per-step latency, tokens/s, audio seconds per "
                                   "second (GPT alone and with the wav decode), time to first audio and peak "
                                   "memory.")
    b.add_argument("mode", nargs="?", default="engine", choices=["engine", "stream", "serve"],
                   help="engine: decode speed of both paths (default); stream: concurrent streaming calls, time "
                        "to first audio and real-time factor, velocity vs upstream-style reference streaming; "
                        "serve: drive a running speech server (--url) over HTTP")
    b.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64, 256],
                   help="stream and serve modes: concurrent streams per level (default: 1 8 64 256)")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="serve mode: the server to drive")
    b.add_argument("--api-key", default=None, help="serve mode: the server's API key")
    b.add_argument("--streams-per-process", type=int, default=16,
                   help="serve mode: clients per client process; larger levels use several (default: 16)")
    b.add_argument("--trace", action="store_true",
                   help="serve mode: keep every request's times in the JSON and send each with an X-Request-Id")
    b.add_argument("--requests-per-stream", type=int, default=2,
                   help="serve mode: requests each client makes in a row (default: 2)")
    b.add_argument("--realtime", action="store_true",
                   help="serve mode: drive the realtime WebSocket instead (/v1/audio/speech/stream): per level "
                        "that many sockets, one context each, text appended word by word; first audio after the "
                        "first sentence's end, underruns, barge-ins (cancel to silence, to KV blocks free)")
    b.add_argument("--words-per-s", type=float, default=15.0,
                   help="serve --realtime: how fast each context's text is appended (default: 15)")
    b.add_argument("--barge-in", type=float, default=0.2, metavar="FRACTION",
                   help="serve --realtime: share of contexts cancelled at their first audio (default: 0.2)")
    b.add_argument("--sentences", type=int, default=3,
                   help="serve --realtime: sentences of each context's text (default: 3)")
    b.add_argument("--size", default="full", choices=SIZES, help="full (real shapes) or tiny random weights")
    b.add_argument("--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES),
                   help="batch sizes: concurrent requests submitted at once (default: 1 16 64 256)")
    b.add_argument("--tokens", type=int, default=500, help="audio tokens generated per sequence, exactly")
    b.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, else cpu)")
    b.add_argument("--dtype", default=None, choices=DTYPES,
                   help="velocity engine dtype (default: float16 on cuda, float32 on cpu); the reference "
                        "runs in float32 as upstream does")
    b.add_argument("--json", default="bench.json", help="results file (default: bench.json)")
    b.add_argument("--plot", default=None, metavar="PNG", help="also draw a chart (needs matplotlib)")
    b.add_argument("--skip-reference", action="store_true", help="measure the velocity engine only")
    b.add_argument("--reference-max-batch", type=int, default=None, metavar="N",
                   help="run the reference only at batches <= N (default: every batch)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random weights and of sampling")
    b.add_argument("--repeats", type=int, default=1, help="timed runs per variant; figures are medians")
    b.add_argument("--decode-batch", type=int, default=32,
                   help="sequences per Decoder+Vocos call when decoding the wavs (default: 32)")
    b.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine: running sequences (default: the batch)")
    b.add_argument("--kv-cache-gib", type=float, default=None,
                   help="engine: KV cache size (default: what the batch needs)")
    b.add_argument("--prefix-caching", action="store_true",
                   help="engine: share equal prompt prefixes (off by default: every request has the same "
                        "prompt, and the warm-up run would fill the cache for the timed one)")
    b.add_argument("--enforce-eager", action="store_true", help="engine: no CUDA graphs")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=_bench)
