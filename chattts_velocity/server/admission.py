"""``Admission``: at most ``max_concurrent`` requests generate at once and ``max_queue`` wait for a slot; a
request beyond both is refused at once (the server answers 429 with ``Retry-After``) instead of queueing
without bound. A request is counted from ``admit`` (in the handler, so a burst is counted as it arrives) until
its ticket is done or cancelled (a response whose body never started). Used from the event loop only."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class QueueFullError(RuntimeError):
    """Every slot is taken and the queue is full."""


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int):
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_concurrent)

    def admit(self) -> Ticket:
        """A place in the queue, or ``QueueFullError``."""
        if self.running + self.waiting >= self.max_concurrent + self.max_queue:
            raise QueueFullError(
                f"the server is at capacity ({self.max_concurrent} requests running, {self.max_queue} queued): "
                "retry later"
            )
        self.waiting += 1
        return Ticket(self)


class Ticket:
    """One admitted request: ``slot`` waits for a running slot and holds it (``take_if_free`` takes it early,
    in the handler, when one is free); ``cancel`` gives the queue place back if no slot was taken
    (idempotent), ``release`` a slot taken early whose ``slot`` never came (a body that never started)."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._queued = True
        self._held = False

    def cancel(self) -> None:
        if self._queued:
            self._queued = False
            self._admission.waiting -= 1

    async def take_if_free(self) -> bool:
        """Take a running slot now if one is free, without waiting (a request then starts before its body)."""
        adm = self._admission
        if self._held or adm._slots.locked():
            return False
        await adm._slots.acquire()  # free: returns without suspending
        self._hold()
        return True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission.running -= 1
            self._admission._slots.release()

    def _hold(self) -> None:
        self.cancel()
        self._admission.running += 1
        self._held = True

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if not self._held:
            try:
                await self._admission._slots.acquire()
            except BaseException:
                self.cancel()
                raise
            self._hold()
        try:
            yield
        finally:
            self.release()
