"""``chattts-velocity`` command line: ``say`` (text to a wav file), ``serve`` (the OpenAI-compatible speech
server), ``make-checkpoint`` (random weights) and ``bench`` (reference vs velocity engine on random weights)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from .config import SAMPLE_RATE

if TYPE_CHECKING:
    from .bench.config import BenchConfig


def _say(args: argparse.Namespace) -> int:
    import numpy as np
    import soundfile as sf

    from .chat import Chat

    ext = os.path.splitext(args.output)[1].lower()
    if ext not in (".wav", ".flac", ".ogg"):
        raise ValueError(f"output must end in .wav, .flac or .ogg, got {args.output!r}")
    chat = _load(args)
    speaker = args.speaker
    if speaker is None and args.random_speaker:
        speaker = chat.sample_random_speaker()
    code = Chat.InferCodeParams(spk_emb=speaker, manual_seed=args.seed, prompt=args.prompt,
                                max_new_token=args.max_new_token)
    refine = Chat.RefineTextParams(manual_seed=args.seed)
    wavs = chat.infer(args.text, skip_refine_text=args.no_refine, params_infer_code=code,
                      params_refine_text=refine)
    audio = np.concatenate(wavs) if wavs else np.zeros(0, dtype=np.float32)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    sf.write(args.output, audio, SAMPLE_RATE)
    print(f"wrote {args.output}: {audio.size / SAMPLE_RATE:.2f} s of audio at {SAMPLE_RATE} Hz")
    return 0


def _load(args: argparse.Namespace, **engine):
    from .chat import Chat

    chat = Chat()
    if args.dummy:
        chat.load(device=args.device, load_format="dummy", **engine)
    elif args.model is not None:
        chat.load(source="custom", custom_path=args.model, device=args.device, **engine)
    else:
        chat.load(source=args.source, device=args.device, **engine)
    return chat


def _serve(args: argparse.Namespace) -> int:
    import torch

    try:
        from .server import ServerConfig
        from .server.run import serve
    except ImportError as e:
        raise ValueError(f"the server needs its extras: pip install \"chattts-velocity[server]\" ({e})") from None
    config = ServerConfig(
        max_concurrent=args.max_concurrent, max_queue=args.max_queue, max_input_chars=args.max_input_chars,
        api_key=args.api_key, voices_dir=args.voices_dir, shutdown_timeout_s=args.shutdown_timeout,
        max_new_token=args.max_new_token,
    )
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    engine = dict(max_num_seqs=args.max_num_seqs or config.max_concurrent * config.in_flight_sentences,
                  kv_cache_gib=args.kv_cache_gib, engine_dtype=args.engine_dtype or ("float16" if cuda else "float32"))
    chat = _load(args, **engine)
    print(f"serving on http://{args.host}:{args.port} (OpenAI /v1/audio/speech)", flush=True)
    return serve(chat, config, host=args.host, port=args.port, log_level=args.log_level)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a folder with the upstream asset/ layout (default: 2Noise/ChatTTS from the "
                                     "Hugging Face cache, downloaded if absent)")
    src.add_argument("--dummy", action="store_true", help="full-size random weights (offline; output is noise)")
    p.add_argument("--source", default="huggingface", choices=["huggingface", "local"],
                   help="where to find the real weights when --model is not given")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="the OpenAI-compatible speech server (POST /v1/audio/speech)",
                       description="One process, one engine shared by every request. Needs the server extras: "
                                   "pip install \"chattts-velocity[server]\".")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $CHATTTS_VELOCITY_API_KEY, else none)")
    s.add_argument("--max-concurrent", type=int, default=64, help="requests generating at once (default: 64)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot; beyond it 429 with Retry-After (default: 256)")
    s.add_argument("--max-input-chars", type=int, default=4096, help="longest input (default: 4096)")
    s.add_argument("--voices-dir", default=None, help="where registered voices are kept across restarts")
    s.add_argument("--max-new-token", type=int, default=2048, help="most audio tokens per sentence (default: 2048)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM (default: 30)")
    s.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine: sequences decoded together (default: max-concurrent x 4 sentences)")
    s.add_argument("--kv-cache-gib", type=float, default=None, help="engine: KV cache size")
    s.add_argument("--engine-dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="engine dtype (default: float16 on CUDA, float32 on CPU)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=_serve)


def _make_checkpoint(args: argparse.Namespace) -> int:
    from .model.checkpoint import write_checkpoint

    write_checkpoint(args.dir, size=args.size, seed=args.seed)
    print(f"wrote a random {args.size} ChatTTS checkpoint to {args.dir}")
    return 0


def _bench_config(args: argparse.Namespace) -> BenchConfig:
    from .bench.config import BenchConfig

    return BenchConfig(
        size=args.size, batches=tuple(args.batch), tokens=args.tokens, device=args.device, dtype=args.dtype,
        json_path=args.json, plot_path=args.plot, skip_reference=args.skip_reference,
        reference_max_batch=args.reference_max_batch, seed=args.seed, repeats=args.repeats,
        decode_batch=args.decode_batch, max_num_seqs=args.max_num_seqs, kv_cache_gib=args.kv_cache_gib,
        prefix_caching=args.prefix_caching, enforce_eager=args.enforce_eager,
        show_progress=not args.no_progress,
    )


def _bench(args: argparse.Namespace) -> int:
    if args.mode == "serve":
        from .bench.serve import ServeBenchConfig
        from .bench.serve import run_and_report as run_serve

        run_serve(ServeBenchConfig(
            url=args.url.rstrip("/"), streams=tuple(args.streams), requests_per_stream=args.requests_per_stream,
            api_key=args.api_key, json_path=args.json if args.json != "bench.json" else "bench_serve.json",
            plot_path=args.plot,
        ))
        return 0
    if args.mode == "stream":
        from .bench.stream import StreamBenchConfig
        from .bench.stream import run_and_report as run_stream

        run_stream(StreamBenchConfig(
            streams=tuple(args.streams), tokens=args.tokens, size=args.size, device=args.device, dtype=args.dtype,
            repeats=args.repeats if args.repeats > 1 else 2,
            reference_max_streams=0 if args.skip_reference else args.reference_max_batch,
            json_path=args.json if args.json != "bench.json" else "bench_stream.json",
        ))
        return 0
    from .bench.runner import run_and_report

    run_and_report(_bench_config(args))
    return 0


def _add_bench_parser(sub) -> None:
    from .bench.config import DEFAULT_BATCHES, DTYPES, SIZES

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
    b.add_argument("--requests-per-stream", type=int, default=2,
                   help="serve mode: requests each client makes in a row (default: 2)")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chattts-velocity", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    say = sub.add_parser("say", help="synthesise text to an audio file")
    say.add_argument("text", help="text to speak (sentences are split and batched as ChatTTS does)")
    say.add_argument("-o", "--output", default="out.wav", help="output file (.wav, .flac, .ogg)")
    _add_model_args(say)
    say.add_argument("--seed", type=int, default=None, help="manual_seed for reproducible output")
    spk = say.add_mutually_exclusive_group()
    spk.add_argument("--speaker", default=None, help="a speaker string (from sample_random_speaker)")
    spk.add_argument("--random-speaker", action="store_true", help="sample a random speaker")
    say.add_argument("--prompt", default="[speed_5]", help="code prompt, e.g. [speed_5]")
    say.add_argument("--max-new-token", type=int, default=2048, help="audio tokens per sentence at most")
    say.add_argument("--no-refine", action="store_true", help="skip the text-refine pass")
    say.set_defaults(func=_say)

    mk = sub.add_parser("make-checkpoint", help="write a random checkpoint in the upstream file layout")
    mk.add_argument("dir", help="output folder (asset/ is created inside)")
    mk.add_argument("--size", default="tiny", choices=["tiny", "full"], help="tiny (tests) or full (real shapes)")
    mk.add_argument("--seed", type=int, default=0, help="random seed")
    mk.set_defaults(func=_make_checkpoint)

    _add_serve_parser(sub)
    _add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .model.loader import ModelNotFoundError

    try:
        return args.func(args)
    except (ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
