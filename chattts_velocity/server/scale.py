"""The speech server on Ray Serve: one engine replica per GPU, on one machine or a cluster of them
(``chattts-velocity serve --replicas N``, or ``serve run chattts_velocity.server.scale:app_builder model=DIR
replicas=2``; needs ``pip install -e ".[scale]"`` from a clone, or ``"chattts-velocity[scale]"``).

Each replica is the server's front, ``build_app`` over a ``ReplicaClient``, and its engine runs in a process of
its own that the replica starts (the engine process of ``serve --fronts``, on the replica's GPU): the replica's
process only prepares requests and moves bytes between Serve and the engine process, and neither waits on the
other's GIL. The routes, schema, errors, streaming and SSE are the server's, and so are the limits: each replica
admits its own ``max_concurrent`` running and ``max_queue`` waiting requests and answers 429 (OpenAI's error body,
``Retry-After``) beyond them. HTTP comes in through Serve's HAProxy, which hands each connection to the replica
with the fewest (``ScaleConfig.ingress`` haproxy: the replica serves it with its own HTTP server, or with
``fronts`` > 1 its front processes take over that server's socket: ``replica_fronts.py``), or through
Serve's Python proxy, which sends each request to the replica whose engine has the least work
(``routing.EngineLoadRouter``) and relays the body; either way a client that goes away has its request cancelled
in the engine process (the body's ``finally``), freeing its blocks.
Two small actors shared by the replicas (``cluster.py``; Serve deployment actors, living as long as the
deployment) hold what every replica must see: registered voices, and every replica's latest report (metrics,
admitted requests) with whether the application drains.

Ray is imported by this module, ``cluster.py`` and ``routing.py`` only: the rest of the package works without it."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import ray
from ray import serve
from ray.serve._private.constants import (
    RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT,
    RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT,
)
from ray.serve.config import BackpressureConfig, DeploymentActorConfig, RequestRouterConfig
from ray.serve.exceptions import RayServeException

from ..serving.engine_process.host import EngineSettings
from .admission import Backlog, shared_counts
from .app import build_app
from .cluster import ReplicaBoard, ReplicaLink, VoiceStore
from .replica_fronts import ReplicaClient, ReplicaFronts, ReplicaHeader, find_listener
from .routing import EngineLoadRouter, routing_stats
from .run import _admission
from .settings import DIRECT_INGRESS_ENV, HAPROXY_ENV, ScaleConfig, ServerConfig, ServeSettings, parse_options

logger = logging.getLogger("ray.serve")  # Serve writes it to the replica's log

APP_NAME = "chattts-velocity"
HEADROOM = 4
"""Requests a replica takes beyond its speech requests' ``max_concurrent + max_queue``: Serve counts every request
as ongoing, so without them ``/metrics``, ``/health``, voice requests and the speech requests that the replica
refuses (429) would wait at Serve's proxy behind a full replica's streams."""
DIRECT_INGRESS_PORTS = range(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT + 1)
"""Where Serve's HAProxy ingress binds a replica's own HTTP server: the socket its fronts take over."""
DRAIN_POLL_S = 0.25
"""How often ``run`` asks whether the draining replicas are done."""


@serve.deployment(name="SpeechServer")
@serve.ingress()
class SpeechReplica:
    """The server's front over an engine process of its own (see the module)."""

    def __init__(self, server: ServerConfig, load: dict, stall_s: float, metrics_period_s: float, fronts: int = 1,
                 log_level: str = "info"):
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.server = server
        link = ReplicaLink(self.replica, metrics_period_s)
        # Ray shows a replica only its own GPU, as ``cuda``, and the engine process inherits that view: an unset
        # device and dtype are chosen there
        engine = EngineSettings(voices_dir=server.voices_dir, audio_round_ms=server.audio_round_ms,
                                audio_thread=server.audio_thread, stall_s=stall_s)
        # with fronts, this process is one more front of its engine process: the one that serves until they
        # take over Serve's socket (and alone, if that fails)
        ends = fronts + 1 if fronts > 1 else 1
        self.counts = shared_counts(ends)  # every front's admission, where the engine process sees it too
        self.client = ReplicaClient.start_engine(load, engine, fronts=ends, backlog=Backlog(self.counts,
                                                 server.max_concurrent), link=link, replica=self.replica,
                                                 front_count=ends, beat_timeout_s=server.engine_timeout_s)
        self.fronts = None
        try:
            info = self.client.wait_ready()
            if fronts > 1:
                self.fronts = ReplicaFronts(self.client, server, self.counts, self.replica, context.app_name,
                                            desk={"put": link.voices.put, "all": link.voices.all, "peers": link.peers},
                                            log_level=log_level, log=logger)
        except BaseException:
            self.client.close(0)
            raise
        logger.info("replica %s: engine process %d on %s, %d HTTP fronts", self.replica, self.client.process.pid,
                    info.device, fronts)
        self.state = None

    def __serve_build_asgi_app__(self):
        app = build_app(self.client, self.server, _admission(self.server, self.counts, 0),
                        metric_labels={"replica": self.replica})
        self.state = app.state.speech
        self.client.link.start_reporting(self.state, self.client.stats, self.client.sibling_metrics, self._drain_fronts)
        app.add_middleware(ReplicaHeader, replica=self.replica)
        if self.fronts is not None:  # Serve's server listens once the app is built: hand its socket to the fronts
            threading.Thread(target=self.fronts.hand_over, args=(lambda: find_listener(DIRECT_INGRESS_PORTS),),
                             name="replica-hand-over", daemon=True).start()
        return app

    def _drain_fronts(self) -> None:
        if self.fronts is not None:
            self.fronts.drain()

    async def record_routing_stats(self) -> dict:
        """Serve asks every ``request_routing_stats_period_s``: this replica's engine load, for
        ``EngineLoadRouter``."""
        admission = self.state.admission if self.state is not None else None
        admitted = admission.running + admission.waiting if admission is not None else 0
        return routing_stats(await self.client.stats(), admitted)

    def drain(self) -> None:
        """Through a handle (``run``): this replica, and every other within a report period, answers new speech
        requests 503 and ``/health`` 503, as a lone server does on SIGTERM; the route stays, and with it the
        streams in flight."""
        self.state.draining = True
        self._drain_fronts()
        self.client.link.drain()

    def drained(self) -> bool:
        """Through a handle: whether every replica drains and has no speech request left."""
        return self.client.link.drained()

    def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; raising marks the replica for replacement: its
        engine process exited, hangs (no beat for ``engine_timeout_s``) or has had work for ``stall_s`` without
        finishing a step."""
        why = self.client.health() or (self.fronts.health() if self.fronts is not None else None)
        if why is not None:
            raise RuntimeError(why)

    def __del__(self) -> None:
        """After Serve drained the replica (``graceful_shutdown_timeout_s``): stop the engine process."""
        if getattr(self, "fronts", None) is not None:  # their streams finish first (they drain)
            self.fronts.close(self.server.shutdown_timeout_s)
            self.fronts = None
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None
            logger.info("replica %s stopped: its engine process is shut down", self.replica)


def application(scale: ScaleConfig, server: ServerConfig, load: dict, fronts: int = 1, log_level: str = "info"):
    """The Serve application: ``SpeechReplica`` with its options, bound to its arguments (``fronts``: HTTP front
    processes per replica, which only Serve's HAProxy ingress reaches)."""
    if fronts > 1 and os.environ.get(HAPROXY_ENV) != "1":
        raise ValueError(f"{fronts} fronts per replica need Serve's HAProxy ingress ({HAPROXY_ENV}=1 and "
                         f"{DIRECT_INGRESS_ENV}=1 on the cluster's nodes, as --ingress haproxy sets): Serve's proxy "
                         "hands every request to the replica's own process")
    options = dict(
        ray_actor_options={"num_gpus": scale.gpus_per_replica, "num_cpus": scale.cpus_per_replica},
        # a replica's own admission refuses what it cannot take (429 with OpenAI's error body, as a lone server)
        max_ongoing_requests=server.max_concurrent + server.max_queue + HEADROOM,
        # Serve queues at each proxy only while every replica has that many (its refusals are quick): bounded
        # like a lone server's connections, beyond which its 429 has Serve's plain-text body
        max_queued_requests=server.max_connections,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=server.retry_after_s),
        health_check_period_s=scale.health_check_period_s,
        graceful_shutdown_timeout_s=server.shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
        deployment_actors=[
            DeploymentActorConfig(name="voices", actor_class=ray.remote(VoiceStore), actor_options={"num_cpus": 0}),
            DeploymentActorConfig(name="board", actor_class=ray.remote(ReplicaBoard), actor_options={"num_cpus": 0}),
        ],
    )
    if os.environ.get(HAPROXY_ENV) != "1":  # Serve's proxy routes (HAProxy balances on its own, by connections)
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=EngineLoadRouter, request_routing_stats_period_s=scale.metrics_period_s,
            request_routing_stats_timeout_s=max(5.0, scale.metrics_period_s))
    if scale.autoscaling:
        target = scale.target_ongoing_requests or max(1.0, 0.75 * server.max_concurrent)
        options["autoscaling_config"] = {"min_replicas": scale.min_replicas, "max_replicas": scale.max_replicas,
                                         "target_ongoing_requests": target}
    else:
        options["num_replicas"] = scale.replicas
    return SpeechReplica.options(**options).bind(server, load, scale.stall_s, scale.metrics_period_s, fronts,
                                                 log_level)


def app_builder(args: dict[str, object]):
    """``serve run chattts_velocity.server.scale:app_builder model=DIR replicas=2 max_concurrent=128``: the
    options of ``chattts-velocity serve`` as key=value (a flag as ``dummy=true``), or as a Serve config's
    ``args`` (``examples/kuberay/rayservice.yaml``). ``serve run`` itself sets the cluster, host and port."""
    settings = ServeSettings.from_options(parse_options(args), replicas=True)
    haproxy = os.environ.get(HAPROXY_ENV) == "1"  # the cluster's, not an argument's, choice
    if "ingress" in args and (settings.scale.ingress == "haproxy") != haproxy:
        runs = "HAProxy" if haproxy else "Serve's proxy"
        raise ValueError(f"ingress={settings.scale.ingress}, but this Ray cluster runs {runs}: {HAPROXY_ENV} and "
                         f"{DIRECT_INGRESS_ENV} in its nodes' environment choose it")
    return application(settings.scale, settings.server, settings.load, settings.fronts, settings.log_level)


class _Stop(Exception):
    """SIGTERM or SIGINT."""


def _raise_stop(*_) -> None:
    raise _Stop


def run(settings: ServeSettings) -> int:
    """Deploy ``settings.scale``'s replicas on its Ray cluster (or a new local Ray instance) and serve until
    SIGTERM/SIGINT; then drain as a lone server does (new speech requests 503, the streams in flight finish, up to
    ``shutdown_timeout_s``), delete the application (Serve gives a stream still going the same time again) and
    return 0. A second signal cuts the wait short."""
    scale, server = settings.scale, settings.server
    ray.init(address=scale.ray_address)
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(sig, _raise_stop)
    try:
        try:
            serve.start(http_options={"host": settings.host, "port": settings.port,
                                      "keep_alive_timeout_s": server.keep_alive_s})
            serve.run(application(scale, server, settings.load, settings.fronts, settings.log_level), name=APP_NAME,
                      route_prefix="/")
            count = f"{scale.min_replicas}-{scale.max_replicas}" if scale.autoscaling else str(scale.replicas)
            print(f"serving on http://{settings.host}:{settings.port} with {count} replicas (Ray Serve)", flush=True)
            while True:
                time.sleep(3600)
        except _Stop:
            pass
        _drain(server.shutdown_timeout_s)
        serve.delete(APP_NAME)
        if scale.ray_address is None:  # our own instance: its proxy and controller go too
            serve.shutdown()
    except _Stop:
        logger.warning("second signal: stopping without waiting for the replicas")
    finally:
        ray.shutdown()
    return 0


def _drain(timeout_s: float) -> None:
    """Every replica drains; wait until none has a speech request left, at most ``timeout_s``. Serve's proxy keeps
    the route meanwhile: a new request gets the replicas' 503, not the 404 of a deleted application."""
    try:
        handle = serve.get_app_handle(APP_NAME)
    except RayServeException:  # a signal before the application was deployed
        return
    deadline = time.monotonic() + timeout_s
    try:
        handle.drain.remote().result(timeout_s=timeout_s)
        while time.monotonic() < deadline and not handle.drained.remote().result(timeout_s=timeout_s):
            time.sleep(DRAIN_POLL_S)
    except (TimeoutError, RayServeException, ray.exceptions.RayError) as e:
        logger.warning("the replicas did not drain (%s): the application is deleted now", e)
