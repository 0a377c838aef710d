"""What the Ray Serve replicas of one speech server share (``scale.py``): two small actors, registered voices
(``VoiceStore``) and what every replica reports each period (``ReplicaBoard``: its metrics, its admitted requests,
and whether the application drains); each replica's ``ReplicaLink`` to them; and ``ReplicaClient``, the replica's
front to its own engine process with the two plugged in, so that the app over it is the server's."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import ray
from prometheus_client import Metric
from ray import serve

from ..engine import EngineStats
from ..serving.engine_process.remote import RemoteClient
from ..serving.voices import Voice
from .metrics import labelled

if TYPE_CHECKING:
    from .app import SpeechState

logger = logging.getLogger("ray.serve")  # Serve writes it to the replica's log


class VoiceStore:
    """Registered voices (``asdict(Voice)`` records by id), shared by every replica."""

    def __init__(self):
        self.records: dict[str, dict] = {}

    def put(self, record: dict) -> None:
        self.records[record["id"]] = record

    def all(self) -> list[dict]:
        return list(self.records.values())


class Report(NamedTuple):
    """One replica's latest report to the board."""

    at: float
    """When it arrived (the board's monotonic clock)."""
    families: list
    """Its metric families (``Metrics.collect``)."""
    admitted: int
    """Speech requests it has admitted and not finished (running or queued)."""
    draining: bool
    """Whether it was draining when it counted ``admitted``."""


class ReplicaBoard:
    """Every replica's latest report, and whether the application drains (each replica learns it from the
    answer to its next report). A replica that stopped reporting (killed) drops out after ``stale_s``; one that
    shuts down cleanly leaves at once."""

    def __init__(self, stale_s: float = 10.0):
        self.stale_s = stale_s
        self.latest: dict[str, Report] = {}
        self.draining = False

    def report(self, replica: str, families: list, admitted: int = 0, draining: bool = False) -> bool:
        """Record ``replica``'s report; returns whether the application drains."""
        self.latest[replica] = Report(time.monotonic(), families, admitted, draining)
        return self.draining

    def forget(self, replica: str) -> None:
        self.latest.pop(replica, None)

    def drain(self) -> None:
        self.draining = True

    def drained(self) -> bool:
        """Draining, and every replica has reported since it knew, with no request admitted."""
        return self.draining and all(r.draining and not r.admitted for r in self._live().values())

    def snapshot(self) -> dict[str, list]:
        """Every live replica's latest metric families."""
        return {replica: report.families for replica, report in self._live().items()}

    def _live(self) -> dict[str, Report]:
        now = time.monotonic()
        self.latest = {r: report for r, report in self.latest.items() if now - report.at <= self.stale_s}
        return self.latest


class _Shared:
    """A deployment actor by name, looked up again once if it was recreated (a stale handle raises
    ``RayActorError``)."""

    def __init__(self, name: str, timeout_s: float = 10.0):
        self.name, self.timeout_s = name, timeout_s
        self._handle = None

    def send(self, method: str, *args):
        """The call's ``ObjectRef`` (not waited for)."""
        if self._handle is None:
            self._handle = serve.get_deployment_actor(self.name)
        return getattr(self._handle, method).remote(*args)

    def call(self, method: str, *args):
        """Blocking: from worker threads only."""
        try:
            return ray.get(self.send(method, *args), timeout=self.timeout_s)
        except ray.exceptions.RayActorError:
            self._handle = None
            return ray.get(self.send(method, *args), timeout=self.timeout_s)

    async def acall(self, method: str, *args):
        try:
            return await self.send(method, *args)
        except ray.exceptions.RayActorError:
            self._handle = None
            return await self.send(method, *args)


class _StoreVoices:
    """``VoiceRegistry``'s ``SharedVoices`` over the ``VoiceStore`` actor."""

    def __init__(self, store: _Shared):
        self.store = store

    def put(self, record: dict) -> None:
        self.store.call("put", record)

    def all(self) -> list[dict]:
        return self.store.call("all")


class ReplicaLink:
    """A replica's link to the others: the shared ``voices`` (``VoiceRegistry``'s ``SharedVoices``), their
    latest metrics (``peers``) and the drain. A thread reports this replica every ``period_s``."""

    def __init__(self, replica: str, period_s: float):
        self.replica, self.period_s = replica, period_s
        self.voices = _StoreVoices(_Shared("voices"))
        self.board = _Shared("board")
        self._stop = threading.Event()

    def start_reporting(self, state: SpeechState, stats: Callable[[], Awaitable[EngineStats]]) -> None:
        """Report ``state``'s metrics (with the engine's ``stats()``, awaited) and admitted requests every
        period, from a thread of its own; once the board says the application drains, ``state`` drains too."""
        threading.Thread(target=self._report, args=(state, stats), name="replica-report", daemon=True).start()

    def _report(self, state: SpeechState, stats: Callable[[], Awaitable[EngineStats]]) -> None:
        loop = asyncio.new_event_loop()  # the engine process's answers are awaited here, not on the server's loop
        try:
            while not self._stop.wait(self.period_s):
                try:
                    draining = state.draining  # before counting: a request admitted after it is refused
                    admission = state.admission
                    admitted = admission.running + admission.waiting
                    engine = loop.run_until_complete(asyncio.wait_for(stats(), 5 * self.period_s))
                    if self.board.call("report", self.replica, state.metrics.collect(engine), admitted, draining):
                        state.draining = True
                except Exception as e:  # noqa: BLE001 - the board is being recreated, the engine busy: next period
                    logger.warning("replica report failed: %r", e)
        finally:
            loop.close()

    def drain(self) -> None:
        """Tell every replica to drain (each learns it within a period)."""
        self.board.call("drain")

    def drained(self) -> bool:
        """Whether every replica drains and has no request left (``ReplicaBoard.drained``)."""
        return self.board.call("drained")

    async def peers(self) -> list[list[Metric]]:
        """Every other replica's latest families, each series labelled with its replica."""
        families = await self.board.acall("snapshot")
        return [labelled(f, {"replica": r}) for r, f in sorted(families.items()) if r != self.replica]

    def stop(self) -> None:
        """Stop reporting and take this replica off the board (not waited for: the replica is shutting down,
        and its report expires on the board anyway)."""
        self._stop.set()
        try:
            self.board.send("forget", self.replica)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not remove this replica's report: %s", e)


class ReplicaClient(RemoteClient):
    """A replica's front to the engine process it started (``ReplicaClient.start_engine(load, settings,
    link=...)``), with the cluster plugged in: the voices it registers go to the shared store too (and other
    replicas' are found there), and ``peer_metrics`` are the other replicas' series. ``close`` stops the link and
    the engine process."""

    def __init__(self, ends, *, link: ReplicaLink, **kw):
        super().__init__(ends, shared_voices=link.voices, **kw)
        self.link = link

    async def register_voice(self, name: str, wav: np.ndarray, transcript: str) -> Voice:
        voice = await super().register_voice(name, wav, transcript)
        await asyncio.to_thread(self.link.voices.put, asdict(voice))  # a blocking call to the store's actor
        return voice

    async def peer_metrics(self) -> list[list[Metric]]:
        return await self.link.peers()

    def close(self, timeout: float = 30.0) -> None:
        self.link.stop()
        super().close(timeout)
