"""Per-visitor state of the web demo. Every visitor holds one ``Session`` (in a ``gr.State``); a Generate is a
``Run``, and Stop cancels that visitor's run only: the engine requests it holds are aborted (their KV blocks
are free within one engine step) while every other visitor's requests go on. ``chat.interrupt()`` would stop
everyone, so it is never called here."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Run:
    """One generation of one visitor. ``hold`` registers how to cancel what runs now (an engine stream, a
    joined audio stream); ``cancel`` calls it, from any thread, and makes every later ``hold`` cancel at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancel: Callable[[], None] | None = None
        self.cancelled = False

    def hold(self, cancel: Callable[[], None]) -> bool:
        """Make ``cancel`` what Stop calls. False (and ``cancel`` already called) if Stop came first."""
        with self._lock:
            if not self.cancelled:
                self._cancel = cancel
                return True
        cancel()
        return False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel()


class Session:
    """A visitor's run: armed when Generate is pressed, started when its generation leaves Gradio's queue."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._run: Run | None = None
        self._started = False

    def __deepcopy__(self, memo: dict) -> Session:
        # gr.State deep-copies its initial value for every visitor: each gets a fresh, unshared session
        return Session()

    def arm(self) -> None:
        """Generate was pressed: a new run, which Stop can cancel even while it waits in the queue."""
        self._replace(started=False)

    def start(self) -> Run:
        """The generation begins: the armed run (already cancelled if Stop came while it was queued), or a
        new one for an API call that armed none. A run already started, by an earlier call of the same
        visitor, is superseded and cancelled."""
        with self._lock:
            if self._run is not None and not self._started:
                self._started = True
                return self._run
        return self._replace(started=True)

    def stop(self) -> None:
        """Cancel this visitor's run (no-op if none)."""
        with self._lock:
            run = self._run
        if run is not None:
            run.cancel()

    def _replace(self, started: bool) -> Run:
        run = Run()
        with self._lock:
            previous, self._run, self._started = self._run, run, started
        if previous is not None:
            previous.cancel()
        return run
