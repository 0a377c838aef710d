"""``RemoteAudio``: one request's audio as it comes from the engine process, read like ``JoinedAudio``."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import numpy as np

from ...audio.pump import PENDING


class RemoteAudio:
    """``next`` returns the next chunk (or ``PENDING`` once ``on_ready`` gave a callback and none is there),
    raises ``StopIteration`` at the end and ``RuntimeError`` if generation failed. ``cancel`` from any thread:
    ``on_cancel(rid)`` then tells the engine process, once."""

    def __init__(self, rid: str, on_cancel: Callable[[str], None]):
        self.rid = rid
        self._on_cancel = on_cancel
        self._cond = threading.Condition()
        self._items: deque[np.ndarray] = deque()
        self._notify = None
        self._over = False
        self._failure: str | None = None

    def __iter__(self) -> RemoteAudio:
        return self

    def __next__(self) -> np.ndarray:
        with self._cond:
            while True:
                if self._items:
                    return self._items.popleft()
                if self._over:
                    if self._failure:
                        failure, self._failure = self._failure, None
                        raise RuntimeError(failure)
                    raise StopIteration
                if self._notify is not None:
                    return PENDING
                self._cond.wait()

    def on_ready(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def start(self) -> None:
        """Nothing to do: the engine process started the request when it got it."""

    def cancel(self) -> None:
        with self._cond:
            if self._over:
                return
            self._over = True
            self._cond.notify_all()
        self._on_cancel(self.rid)

    close = cancel

    def deliver(self, chunk: np.ndarray | None, failure: str | None = None) -> None:
        """A chunk, or (``chunk`` None) the end: ``failure`` says why it failed (None if it did not). Nothing
        arrives after the end or a ``cancel``."""
        with self._cond:
            if self._over:
                return
            if chunk is None:
                self._over, self._failure = True, failure
            else:
                self._items.append(chunk)
            self._cond.notify_all()
            notify = self._notify
        if notify is not None:
            notify()
