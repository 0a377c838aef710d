"""Prometheus metrics of the speech server (``GET /metrics``): requests by route and status, the admission
queue, the engine's load (sequences waiting and running, KV blocks in use, preemptions, tokens) read from its
stats at scrape time, and histograms of time to first audio and real-time factor. Under Ray Serve
(``scale.py``) each replica's families are gathered and ``render_replicas`` renders them all, labelled by replica."""

from __future__ import annotations

import gc
import time
import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_TTFA_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1, 2, 5, 10)
_RTF_BUCKETS = (0.5, 1, 2, 4, 8, 16, 32, 64)
_PREPARE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
_GC_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2)


class Metrics:
    def __init__(self, engine, admission):
        self.engine, self.admission = engine, admission
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
                                 "tokens, validation: what the response headers wait for; with --engine-process a "
                                 "refine request's round trip to the engine process)", registry=r, buckets=_PREPARE_BUCKETS)
        self.rtf = Histogram("chattts_real_time_factor", "seconds of audio per second of wall time", registry=r,
                             buckets=_RTF_BUCKETS)
        self.gc_pause = Histogram("chattts_gc_pause_seconds", "Python garbage collections (the process stands "
                                  "still: the GIL is held)", ["generation"], registry=r, buckets=_GC_BUCKETS)
        _watch_gc(self)

    def count(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def first_audio(self, seconds: float) -> None:
        self.ttfa.observe(seconds)

    def finished(self, audio_s: float, wall_s: float) -> None:
        if wall_s > 0 and audio_s > 0:
            self.rtf.observe(audio_s / wall_s)

    def render(self, others: list[list[Metric]] = ()) -> tuple[bytes, str]:
        """The exposition; ``others``: other fronts' ``own()`` families, added to this one's series (``serve
        --fronts``: every front serves requests, and any one of them answers ``/metrics``)."""
        self.refresh()
        if not others:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        return _expose(_Summed(list(self.registry.collect()), others))

    def own(self) -> list[Metric]:
        """This process's request counters and histograms (not the gauges: the engine's and the admission's
        are the same from every front)."""
        return [family for family in self.registry.collect() if family.type in ("counter", "histogram")]

    def collect(self) -> list[Metric]:
        """Every family, refreshed now (what a replica reports to the others)."""
        self.refresh()
        return list(self.registry.collect())

    def refresh(self) -> None:
        """Set the gauges from the admission counts and the engine's latest stats."""
        stats = self.engine.stats().engine
        self.queue.set(self.admission.waiting)
        self.running.set(self.admission.running)
        self.seqs_waiting.set(stats.num_waiting)
        self.seqs_running.set(stats.num_running)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.preemptions.set(stats.num_preemptions)
        self.tokens.set(stats.num_generated_tokens)


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
    """Families with other fronts' samples (``Metrics.own``: counters and histograms) added in (a ``_created``
    sample: the earliest)."""

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


class _Replicas:
    """A collector of several replicas' families: one family per name, each sample labelled ``replica``."""

    def __init__(self, families_by_replica: dict[str, list[Metric]]):
        self.families_by_replica = families_by_replica

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, families in sorted(self.families_by_replica.items()):
            for family in families:
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
                into.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
        yield from merged.values()


def render_replicas(families_by_replica: dict[str, list[Metric]]) -> tuple[bytes, str]:
    """One exposition of several replicas' ``Metrics.collect()``, every series labelled with its replica."""
    return _expose(_Replicas(families_by_replica))


def _expose(collector) -> tuple[bytes, str]:
    """The exposition of what ``collector`` yields."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry), CONTENT_TYPE_LATEST
