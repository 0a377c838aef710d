"""What the Ray Serve replicas of one speech server share (``scale.py``): two small actors, registered voices
(``VoiceStore``) and what every replica reports each period (``ReplicaBoard``: its metrics, its admitted requests,
and whether the application drains); and each replica's ``ReplicaLink`` to them, which its fronts'
``replica_fronts.ReplicaClient`` plugs in, so that the app over it is the server's."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple

import ray
from prometheus_client import Metric
from ray import serve

from ..engine import EngineStats
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
    """Its metric families: its own front's ``Metrics.collect``, then each other front's ``Metrics.own``."""
    admitted: int
    """Speech requests it has admitted and not finished (running or queued)."""
    draining: bool
    """Whether it was draining when it counted ``admitted``."""


class ReplicaBoard:
    """Every replica's latest report (its fronts' metric families, a list of lists), and whether the application drains (each replica learns it from the
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
        """Every live replica's latest metric families (a list per front)."""
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

    def start_reporting(self, state: SpeechState, stats: Callable[[], Awaitable[EngineStats]],
                        siblings: Callable[[], Awaitable[list]], on_drain: Callable[[], None]) -> None:
        """Report ``state``'s metrics (with the engine's ``stats()``, awaited), the replica's other fronts'
        (``siblings()``, awaited) and the requests its fronts admitted, every period, from a thread of its own;
        once the board says the application drains, ``state`` drains, and ``on_drain()`` drains the others."""
        threading.Thread(target=self._report, args=(state, stats, siblings, on_drain), name="replica-report",
                         daemon=True).start()

    def _report(self, state: SpeechState, stats: Callable[[], Awaitable[EngineStats]],
                siblings: Callable[[], Awaitable[list]], on_drain: Callable[[], None]) -> None:
        loop = asyncio.new_event_loop()  # the engine process's answers are awaited here, not on the server's loop
        try:
            while not self._stop.wait(self.period_s):
                try:
                    draining = state.draining  # before counting: a request admitted after it is refused
                    admission = state.admission
                    admitted = admission.running + admission.waiting
                    engine = loop.run_until_complete(asyncio.wait_for(stats(), 5 * self.period_s))
                    others = loop.run_until_complete(siblings())
                    families = [state.metrics.collect(engine), *others]
                    if self.board.call("report", self.replica, families, admitted, draining):
                        state.draining = True
                        on_drain()
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

    def peers(self) -> list[list[Metric]]:
        """Every other replica's latest families, each series labelled with its replica (blocking)."""
        fronts = self.board.call("snapshot")
        return [labelled(f, {"replica": r}) for r, lists in sorted(fronts.items()) if r != self.replica for f in lists]

    def stop(self) -> None:
        """Stop reporting and take this replica off the board (not waited for: the replica is shutting down,
        and its report expires on the board anyway)."""
        self._stop.set()
        try:
            self.board.send("forget", self.replica)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not remove this replica's report: %s", e)
