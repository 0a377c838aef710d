"""The ``chattts-velocity bench`` subcommand: its parser and the dispatch to the engine, stream, serve and serve
--realtime modes."""

from __future__ import annotations

import argparse

from ..server.settings import parse_window_stops
from .agreement import AgreementConfig
from .agreement import run_and_report as run_agreement
from .config import DEFAULT_BATCHES, DTYPES, SIZES, BenchConfig
from .open_loop import OpenLoopConfig
from .open_loop import run_and_report as run_open_loop
from .realtime import RealtimeBenchConfig
from .realtime import run_and_report as run_realtime
from .runner import run_and_report
from .serve import ServeBenchConfig
from .serve import run_and_report as run_serve
from .stream import StreamBenchConfig
from .stream import run_and_report as run_stream


def bench_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        size=args.size, batches=tuple(args.batch), tokens=args.tokens, device=args.device,
        dtypes=tuple(args.dtype or ()),
        json_path=args.json, plot_path=args.plot, skip_reference=args.skip_reference,
        reference_max_batch=args.reference_max_batch, seed=args.seed,
        repeats=1 if args.repeats is None else args.repeats, decode_batch=args.decode_batch,
        max_num_seqs=args.max_num_seqs, kv_cache_gib=args.kv_cache_gib,
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


def open_loop_config(args: argparse.Namespace) -> OpenLoopConfig:
    return OpenLoopConfig(
        url=args.url.rstrip("/"), rates=tuple(args.rates), duration_s=args.duration,
        p95_target_ms=args.p95_target_ms, seed=args.seed, api_key=args.api_key,
        json_path=args.json if args.json != "bench.json" else "bench_open_loop.json",
        streams_per_process=args.streams_per_process,
    )


def _bench(args: argparse.Namespace) -> int:
    if args.realtime and args.mode != "serve":
        raise ValueError("--realtime drives a running server: chattts-velocity bench serve --realtime")
    if args.rates and (args.mode != "serve" or args.realtime):
        raise ValueError("--rates drives a running server in open loop: chattts-velocity bench serve --rates 5 20 80")
    if args.realtime:
        run_realtime(realtime_config(args))
        return 0
    if args.rates:
        run_open_loop(open_loop_config(args))
        return 0
    if args.mode == "serve":
        run_serve(ServeBenchConfig(
            url=args.url.rstrip("/"), streams=tuple(args.streams), requests_per_stream=args.requests_per_stream,
            api_key=args.api_key, json_path=args.json if args.json != "bench.json" else "bench_serve.json",
            plot_path=args.plot, streams_per_process=args.streams_per_process, trace=args.trace,
        ))
        return 0
    if args.mode == "agreement":
        if args.device not in (None, "cpu"):
            raise ValueError("bench agreement compares the CPU engine dtypes: leave out --device or give cpu")
        run_agreement(AgreementConfig(
            size=args.size, batches=tuple(args.batch), tokens=args.tokens, dtypes=tuple(args.dtype or AgreementConfig.dtypes),
            seed=args.seed, json_path=args.json if args.json != "bench.json" else "bench_agreement.json",
        ))
        return 0
    if args.mode == "stream":
        if args.dtype and len(args.dtype) > 1:
            raise ValueError(f"bench stream measures one engine dtype, got --dtype {' '.join(args.dtype)}")
        stops = StreamBenchConfig.window_stops if args.window_stops is None else parse_window_stops(args.window_stops)
        run_stream(StreamBenchConfig(
            streams=tuple(args.streams), tokens=args.tokens, size=args.size, device=args.device,
            dtype=args.dtype[0] if args.dtype else None,
            repeats=StreamBenchConfig.repeats if args.repeats is None else args.repeats,
            reference_max_streams=0 if args.skip_reference else args.reference_max_batch,
            json_path=args.json if args.json != "bench.json" else "bench_stream.json",
            window_stops=stops, **({} if args.stream_chunk is None else {"chunk": args.stream_chunk}),
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
    b.add_argument("mode", nargs="?", default="engine", choices=["engine", "stream", "serve", "agreement"],
                   help="engine: decode speed of both paths (default); stream: concurrent streaming calls, time "
                        "to first audio and real-time factor, velocity vs upstream-style reference streaming; "
                        "serve: drive a running speech server (--url) over HTTP; agreement: each CPU engine "
                        "dtype's top-1 codes (and wav SNR) against the float32 engine's under teacher forcing "
                        "(--tokens steps, --batch, --dtype; CPU)")
    b.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64, 256],
                   help="stream and serve modes: concurrent streams per level (default: 1 8 64 256)")
    b.add_argument("--url", default="http://127.0.0.1:8000",
                   help="serve mode: the server to drive (default: %(default)s)")
    b.add_argument("--api-key", default=None, help="serve mode: the server's API key (default: none)")
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
    b.add_argument("--rates", type=float, nargs="+", default=None, metavar="REQ_PER_S",
                   help="serve mode, open loop: Poisson arrivals at each rate (requests/s) for --duration s; first "
                        "audio p50/p95/p99, underruns, start delay, failures and the highest sustained rate "
                        "(default: none, the closed-loop --streams levels)")
    b.add_argument("--duration", type=float, default=30.0,
                   help="serve --rates: seconds of arrivals per rate (default: %(default)s)")
    b.add_argument("--p95-target-ms", type=float, default=150.0,
                   help="serve --rates: first audio p95 a rate must stay within to be sustained (default: %(default)s)")
    b.add_argument("--size", default="full", choices=SIZES,
                   help="full (real shapes) or tiny random weights (default: %(default)s)")
    b.add_argument("--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES),
                   help="batch sizes: concurrent requests submitted at once (default: 1 16 64 256)")
    b.add_argument("--tokens", type=int, default=500,
                   help="audio tokens generated per sequence, exactly (default: %(default)s)")
    b.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, else cpu)")
    b.add_argument("--dtype", default=None, nargs="+", choices=DTYPES,
                   help="velocity engine dtypes, each measured beside the reference in the same run (on the CPU "
                        "their timed runs take turns) (default: float16; float32 on a CPU without fbgemm); the "
                        "reference runs in float32 as upstream does")
    b.add_argument("--json", default="bench.json", help="results file (default: bench.json)")
    b.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw a chart (needs matplotlib) (default: none)")
    b.add_argument("--skip-reference", action="store_true", help="measure the velocity engine only")
    b.add_argument("--window-stops", default=None, metavar="N,N",
                   help="stream mode: the engine's window stops, as serve --window-stops (default: the engine's)")
    b.add_argument("--stream-chunk", type=int, default=None, metavar="TOKENS",
                   help="stream mode: most tokens in a later chunk, as serve --stream-chunk (default: the stream's)")
    b.add_argument("--reference-max-batch", type=int, default=None, metavar="N",
                   help="run the reference only at batches <= N (default: every batch)")
    b.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and of sampling; serve --rates: of the arrival times "
                        "(default: %(default)s)")
    b.add_argument("--repeats", type=int, default=None,
                   help="timed runs per variant; figures are medians (default: 1; stream: 2)")
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
