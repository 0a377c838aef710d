"""What the Ray Serve replicas of one speech server share (``scale.py``): two small actors, registered voices
(``VoiceStore``) and every replica's latest metrics (``MetricsBoard``); each replica's ``ReplicaLink`` to them;
and ``ReplicaClient``, the replica's engine client with the two plugged in, so that the app over it is the
one-process server's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray
from prometheus_client import Metric
from ray import serve

from ..engine import EngineStats
from ..serving.local import LocalClient
from .metrics import Metrics, labelled

logger = logging.getLogger("ray.serve")  # Serve writes it to the replica's log


class VoiceStore:
    """Registered voices (``asdict(Voice)`` records by id), shared by every replica."""

    def __init__(self):
        self.records: dict[str, dict] = {}

    def put(self, record: dict) -> None:
        self.records[record["id"]] = record

    def all(self) -> list[dict]:
        return list(self.records.values())


class MetricsBoard:
    """Every replica's latest metric families. A replica that stopped reporting (killed) drops out after
    ``stale_s``; one that shuts down cleanly leaves at once."""

    def __init__(self, stale_s: float = 10.0):
        self.stale_s = stale_s
        self.latest: dict[str, tuple[float, list]] = {}

    def report(self, replica: str, families: list) -> None:
        self.latest[replica] = (time.monotonic(), families)

    def forget(self, replica: str) -> None:
        self.latest.pop(replica, None)

    def snapshot(self) -> dict[str, list]:
        now = time.monotonic()
        self.latest = {r: (t, f) for r, (t, f) in self.latest.items() if now - t <= self.stale_s}
        return {r: f for r, (_, f) in self.latest.items()}


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
    """A replica's link to the others: the shared ``voices`` (``VoiceRegistry``'s ``SharedVoices``), and their
    latest metrics (``peers``). A thread reports this replica's metrics every ``period_s``."""

    def __init__(self, replica: str, period_s: float):
        self.replica, self.period_s = replica, period_s
        self.voices = _StoreVoices(_Shared("voices"))
        self.board = _Shared("metrics")
        self._stop = threading.Event()

    def start_reporting(self, metrics: Metrics, stats: Callable[[], EngineStats]) -> None:
        """Report ``metrics`` (with the engine's ``stats()``) every period, from a thread of its own."""
        threading.Thread(target=self._report, args=(metrics, stats), name="metrics-report", daemon=True).start()

    def _report(self, metrics: Metrics, stats: Callable[[], EngineStats]) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.board.call("report", self.replica, metrics.collect(stats()))
            except Exception as e:  # noqa: BLE001 - the board is being recreated: report next period
                logger.warning("metrics report failed: %s", e)

    async def peers(self) -> list[list[Metric]]:
        """Every other replica's latest families, each series labelled with its replica."""
        families = await self.board.acall("snapshot")
        return [labelled(f, {"replica": r}) for r, f in sorted(families.items()) if r != self.replica]

    def stop(self) -> None:
        """Stop reporting and take this replica's series off the board (not waited for: the replica is
        shutting down, and its series expire on the board anyway)."""
        self._stop.set()
        try:
            self.board.send("forget", self.replica)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not remove this replica's metrics: %s", e)


class ReplicaClient(LocalClient):
    """A replica's ``LocalClient`` over the ``Chat`` it owns, with the cluster plugged in: the voices it
    registers go to the shared store too (and other replicas' are found there), and ``peer_metrics`` are the
    other replicas' series. ``close`` stops the link and unloads the model."""

    def __init__(self, chat, link: ReplicaLink, voices_dir: str | None = None):
        super().__init__(chat, voices_dir, shared_voices=link.voices, owns_chat=True)
        self.link = link

    async def peer_metrics(self) -> list[list[Metric]]:
        return await self.link.peers()

    def close(self) -> None:
        self.link.stop()
        super().close()
