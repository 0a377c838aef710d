"""Prometheus metrics of the speech server (``GET /metrics``): requests by route and status, the admission
queue, the realtime sockets and their contexts, the engine's load (sequences waiting and running, KV blocks in
use, preemptions, tokens) from its stats at scrape time, histograms of time to first audio and real-time
factor, and the engine thread's own (its turns, aborts, and a request's way to its first token and from there to
its first audio). A front of a shared engine (``serve --fronts``) adds the other fronts' request series to its own; a Ray
Serve replica labels its series with its replica and shows every other replica's beside them (``cluster.py``)."""

from __future__ import annotations

import gc
import time
import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.routing import Match

OTHER_ROUTE = "other"
"""The ``route`` label of a request to no known route: one series for every unknown path, however many."""

_TTFA_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1, 2, 5, 10)
_RTF_BUCKETS = (0.5, 1, 2, 4, 8, 16, 32, 64)
_PREPARE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
_GC_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2)


class Metrics:
    def __init__(self, admission, labels: dict[str, str] | None = None):
        """``admission``: the server's ``Admission`` (its counts are gauges); ``labels``: put on every series
        this server renders (a replica's ``replica``), so that another server's series stay apart from them."""
        self.admission, self.labels = admission, labels or {}
        r = self.registry = CollectorRegistry()
        self.requests = Counter("chattts_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.queue = Gauge("chattts_queue_depth", "speech requests waiting for a slot", registry=r)
        self.running = Gauge("chattts_running_requests", "speech requests generating", registry=r)
        self.seqs_waiting = Gauge("chattts_engine_waiting", "engine sequences waiting", registry=r)
        self.seqs_running = Gauge("chattts_engine_running", "engine sequences running", registry=r)
        self.kv_used = Gauge("chattts_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("chattts_kv_blocks_total", "KV cache blocks", registry=r)
        self.preemptions = Gauge("chattts_preemptions", "engine preemptions so far", registry=r)
        self.tokens = Gauge("chattts_generated_tokens", "audio and text tokens generated so far", registry=r)
        self.ttfa = Histogram("chattts_time_to_first_audio_seconds", "request start to first audio", registry=r,
                              buckets=_TTFA_BUCKETS)
        self.prepare = Histogram("chattts_prepare_seconds", "a speech request's preparation (text, voice, "
                                 "tokens, validation, a refine pass: what the response headers wait for)", registry=r, buckets=_PREPARE_BUCKETS)
        self.rtf = Histogram("chattts_real_time_factor", "seconds of audio per second of wall time", registry=r,
                             buckets=_RTF_BUCKETS)
        self.ws_sockets = Gauge("chattts_ws_sockets", "realtime sockets open", registry=r)
        self.ws_contexts = Counter("chattts_ws_contexts", "realtime contexts started", registry=r)
        self.ws_cancels = Counter("chattts_ws_cancels", "realtime contexts cancelled (by the client, or by their "
                                  "socket closing)", registry=r)
        self.gc_pause = Histogram("chattts_gc_pause_seconds", "Python garbage collections (the process stands "
                                  "still: the GIL is held)", ["generation"], registry=r, buckets=_GC_BUCKETS)
        self.engine_timings = _EngineTimings()
        r.register(self.engine_timings)
        _watch_gc(self)

    def count(self, route: str, status: int) -> None:
        """One request to ``route``: a route's path template (``route_label``), never a raw path."""
        self.requests.labels(route=route, status=str(status)).inc()

    def first_audio(self, seconds: float) -> None:
        self.ttfa.observe(seconds)

    def finished(self, audio_s: float, wall_s: float) -> None:
        if wall_s > 0 and audio_s > 0:
            self.rtf.observe(audio_s / wall_s)

    def render(self, stats, peers: list[list[Metric]] = ()) -> tuple[bytes, str]:
        """The exposition, with the engine's ``stats`` (``EngineStats``). ``peers``: other servers' families
        (``EngineClient.peer_metrics``), added to this one's series: summed where they match (other fronts'
        ``own``), beside them where their labels differ (other replicas')."""
        self.refresh(stats)
        if not peers and not self.labels:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        return _expose(_Summed(labelled(list(self.registry.collect()), self.labels), peers))

    def own(self) -> list[Metric]:
        """This server's request counters and histograms (not the gauges: the engine's and the admission's
        are the same from every front of one engine)."""
        return [family for family in self.registry.collect()
                if family.type in ("counter", "histogram")
                and family.name not in _EngineTimings.ENGINE_FAMILIES]

    def collect(self, stats) -> list[Metric]:
        """Every family, with the engine's ``stats`` (what a replica reports to the others)."""
        self.refresh(stats)
        return list(self.registry.collect())

    def refresh(self, stats) -> None:
        """Set the gauges from the admission counts and the engine's ``stats``."""
        self.queue.set(self.admission.waiting)
        self.running.set(self.admission.running)
        self.seqs_waiting.set(stats.num_waiting)
        self.seqs_running.set(stats.num_running)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.preemptions.set(stats.num_preemptions)
        self.tokens.set(stats.num_generated_tokens)
        self.engine_timings.stats = stats


class _EngineTimings:
    """The engine thread's own histograms (``EngineStats.abort_wait``, ``loop_time``, ``first_token_wait``,
    ``first_audio_wait``, ``first_decode_wait``), as of the latest stats:
    the same from every front of one engine, so never summed across fronts (``Metrics.own`` leaves them out)."""

    NAMES = ("chattts_engine_abort_wait_seconds", "chattts_engine_loop_seconds",
             "chattts_engine_first_token_seconds", "chattts_engine_first_audio_seconds",
             "chattts_engine_first_decode_seconds")
    DOCS = ("an abort, from asked to its KV blocks freed",
            "one turn of the engine thread: a step and the audio round after it (an abort waits at most the "
            "turn it arrives in)",
            "a request, from submitted to the engine to its first token: the wait for the step running when it "
            "came, and its prompt step",
            "a streamed request, from its first token to its first audio: its first window and the audio round "
            "that decodes it",
            "a streamed request, from its first audio's tokens reaching the audio pump to its first audio: the "
            "pump's hold for a safe start and the decode (the audio's part of chattts_engine_first_audio_seconds)")
    FIELDS = ("abort_wait", "loop_time", "first_token_wait", "first_audio_wait", "first_decode_wait")
    THREAD = "chattts_engine_thread_seconds"
    """``EngineStats.thread_time``: a counter a part (``timings.THREAD_PARTS``)."""
    COUNTS = (("chattts_engine_prompt_steps", "num_prompt_steps", "engine steps that computed prompts"),
              ("chattts_engine_windows", "num_windows", "decode windows (a host turn each)"),
              ("chattts_engine_window_steps", "num_window_steps", "steps of the decode windows"),
              ("chattts_engine_window_tokens", "num_window_tokens",
               "tokens of the decode windows (their steps times their sequences)"))
    """Counters of the engine's steps (``EngineStats``): the mean window and decode batch over an interval."""
    ENGINE_FAMILIES = frozenset((*NAMES, THREAD, *(name for name, _, _ in COUNTS)))
    """Every family here: one engine's, the same from each of its fronts, so never summed across them."""

    def __init__(self):
        self.stats = None

    def collect(self):
        stats = self.stats
        for name, doc, attr in zip(self.NAMES, self.DOCS, self.FIELDS, strict=True):
            timings = getattr(stats, attr, None)
            if timings is not None:
                yield HistogramMetricFamily(name, doc, buckets=timings.cumulative(), sum_value=timings.total_s)
        for name, attr, doc in self.COUNTS:
            count = getattr(stats, attr, None)
            if count is not None:
                yield CounterMetricFamily(name, doc, value=count)
        parts = getattr(stats, "thread_time", None)
        if parts is not None:
            family = CounterMetricFamily(
                self.THREAD, "the engine thread's time by part: idle (no work), step (the engine's step: "
                "scheduling, launching, reading outputs), deliver (the outputs handed over: the audio round where "
                "it runs on the engine thread), each *_device_wait its waits for the device", labels=["part"])
            for part, seconds in parts.items():
                family.add_metric([part], seconds)
            yield family


def route_label(scope: dict) -> str:
    """The ``route`` label of a request: the path template of the route it matched (or, before routing, of the
    first of its app's routes that matches it), else ``OTHER_ROUTE``."""
    route = scope.get("route")
    if route is None:
        for candidate in getattr(scope.get("app"), "routes", ()):
            if candidate.matches(scope)[0] != Match.NONE:
                route = candidate
                break
    return getattr(route, "path", None) or OTHER_ROUTE


def _watch_gc(metrics: Metrics) -> None:
    """Time every garbage collection into ``metrics.gc_pause`` while ``metrics`` lives."""
    ref, started = weakref.ref(metrics), [0.0]

    def callback(phase: str, info: dict) -> None:
        target = ref()
        if target is None:  # its app is gone (a few bytes stay registered: gc iterates the list it calls)
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            target.gc_pause.labels(generation=str(info["generation"])).observe(time.perf_counter() - started[0])

    gc.callbacks.append(callback)


class _Summed:
    """Families with other servers' samples added in: a sample of the same name and labels is summed (a
    ``_created`` sample: the earliest), any other joins its family."""

    def __init__(self, families: list[Metric], others: list[list[Metric]]):
        self.families, self.others = families, others

    def collect(self):
        extra: dict[str, list] = {}
        for families in self.others:
            for family in families:
                extra.setdefault(family.name, []).extend(family.samples)
        for family in self.families:
            if family.name not in extra:
                yield family
                continue
            values = {(s.name, tuple(sorted(s.labels.items()))): s for s in family.samples}
            for sample in extra[family.name]:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                have = values.get(key)
                if have is None:
                    values[key] = sample
                elif sample.name.endswith("_created"):
                    values[key] = have._replace(value=min(have.value, sample.value))
                else:
                    values[key] = have._replace(value=have.value + sample.value)
            summed = Metric(family.name, family.documentation, family.type, family.unit)
            summed.samples = list(values.values())
            yield summed


def labelled(families: list[Metric], labels: dict[str, str]) -> list[Metric]:
    """``families`` with ``labels`` on every sample."""
    if not labels:
        return families
    out = []
    for family in families:
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [s._replace(labels={**s.labels, **labels}) for s in family.samples]
        out.append(copy)
    return out


def _expose(collector) -> tuple[bytes, str]:
    """The exposition of what ``collector`` yields."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry), CONTENT_TYPE_LATEST
