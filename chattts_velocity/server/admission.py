"""``Admission``: at most ``max_concurrent`` requests generate at once and ``max_queue`` wait for a slot; a
request beyond both is refused at once (the server answers 429 with ``Retry-After``) instead of queueing
without bound. A request is counted from ``admit`` (in the handler, so a burst is counted as it arrives) until
its ticket is done or cancelled (a response whose body never started). Used from the event loop only.

Several front processes of one engine (``serve --fronts``) admit against the same limits: their counts live in
shared memory (``shared_counts``), each front in its own two cells (so a front that dies can be zeroed), and a
front's queued request also looks for a slot another front gave back every ``poll_s``."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

POLL_S = 0.02
"""How often a queued request looks for a slot that another front gave back (``serve --fronts``)."""


class QueueFullError(RuntimeError):
    """Every slot is taken and the queue is full."""


def shared_counts(fronts: int):
    """Counts that ``fronts`` processes admit against together: give it to each front's ``Admission`` (it
    crosses ``multiprocessing``'s spawn as a process argument)."""
    import multiprocessing as mp

    return mp.get_context("spawn").Array("q", 2 * fronts)


def forget_front(counts, index: int) -> None:
    """Zero front ``index``'s counts in ``shared_counts`` (the front died with requests counted)."""
    with counts.get_lock():
        counts[2 * index] = counts[2 * index + 1] = 0


def backlogged(counts, max_concurrent: int) -> bool:
    """Whether every running slot is taken and a request waits for one, over ``counts`` (``shared_counts``,
    which any process that holds them may read, or an ``Admission``'s own list)."""
    lock = counts.get_lock() if hasattr(counts, "get_lock") else contextlib.nullcontext()
    with lock:
        return sum(counts[0::2]) >= max_concurrent and sum(counts[1::2]) > 0


class Backlog:
    """``backlogged`` over ``shared_counts`` as a callable, for an engine process's scheduler
    (``AsyncLLMEngine.set_backlog``); it crosses ``multiprocessing``'s spawn as a process argument."""

    def __init__(self, counts, max_concurrent: int):
        self.counts, self.max_concurrent = counts, max_concurrent

    def __call__(self) -> bool:
        return backlogged(self.counts, self.max_concurrent)


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int, shared=None, index: int = 0):
        """``shared``: ``shared_counts`` of several fronts, this being front ``index``; None: this process
        alone."""
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self._counts = shared if shared is not None else [0, 0]
        self._lock = shared.get_lock() if shared is not None else contextlib.nullcontext()
        self._mine = 2 * index if shared is not None else 0
        self._poll_s = POLL_S if shared is not None else None
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def running(self) -> int:
        """Requests generating, over every front."""
        with self._lock:
            return sum(self._counts[0::2])

    @property
    def backlogged(self) -> bool:
        """Every running slot taken, and a request waiting for one (over every front)."""
        return backlogged(self._counts, self.max_concurrent)

    @property
    def waiting(self) -> int:
        """Requests queued, over every front."""
        with self._lock:
            return sum(self._counts[1::2])

    def admit(self) -> Ticket:
        """A place in the queue, or ``QueueFullError``."""
        with self._lock:
            if sum(self._counts) >= self.max_concurrent + self.max_queue:
                raise QueueFullError(
                    f"the server is at capacity ({self.max_concurrent} requests running, {self.max_queue} queued): "
                    "retry later"
                )
            self._counts[self._mine + 1] += 1
        return Ticket(self)

    def _dequeue(self) -> None:
        with self._lock:
            self._counts[self._mine + 1] -= 1

    def _take(self) -> bool:
        """A running slot for a queued request, if one is free (it leaves the queue)."""
        with self._lock:
            if sum(self._counts[0::2]) >= self.max_concurrent:
                return False
            self._counts[self._mine] += 1
            self._counts[self._mine + 1] -= 1
        return True

    def _give_back(self) -> None:
        with self._lock:
            self._counts[self._mine] -= 1
        self._wake()

    def _wake(self) -> None:
        """Wake this front's longest-waiting request to take a slot. It stays in ``_waiters`` until it runs, so
        that a newcomer's ``take_if_free`` does not take the slot meanwhile."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _acquire(self) -> None:
        """Wait for a running slot and take it, in arrival order among this front's queued requests."""
        if not self._waiters and self._take():
            return
        loop = asyncio.get_running_loop()
        retry = False
        while True:
            waiter = loop.create_future()
            if retry:  # polled in vain, or woken and beaten to the slot by another front: first in line still
                self._waiters.appendleft(waiter)
            else:
                self._waiters.append(waiter)
            try:
                await asyncio.wait([waiter], timeout=self._poll_s)
            except BaseException:
                self._waiters.remove(waiter)
                if waiter.done():
                    self._wake()  # woken, then cancelled: the wake-up goes to the next
                raise
            self._waiters.remove(waiter)
            if self._take():
                return
            retry = True


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
            self._admission._dequeue()

    async def take_if_free(self) -> bool:
        """Take a running slot now if one is free and nobody here waits for one (a request then starts before
        its body)."""
        adm = self._admission
        if self._held or not self._queued or adm._waiters or not adm._take():
            return False
        self._queued, self._held = False, True
        return True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._give_back()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if not self._held:
            if not self._queued:
                raise RuntimeError("this ticket was cancelled")
            try:
                await self._admission._acquire()
            except BaseException:
                self.cancel()
                raise
            self._queued, self._held = False, True
        try:
            yield
        finally:
            self.release()
