"""A timeline of what each thread of each process did, for finding where a server's time goes under load: the
engine's steps and their reads, the hand-over of outputs, the audio rounds and their decodes, the shipper's
writes to the fronts, requests reaching the engine process, a front's preparation of a request, garbage
collections. Written as Chrome trace files (one per process) that Perfetto (ui.perfetto.dev) or
chrome://tracing open, on one clock for every process of the machine.

Off unless ``CHATTTS_VELOCITY_TIMELINE`` names a folder when the process starts (a server's engine process and
fronts inherit it); then each process writes ``<folder>/<process name>-<pid>.json`` at exit, or once it has
recorded ``CHATTTS_VELOCITY_TIMELINE_EVENTS`` spans (default 200,000), after which it records no more. Off, the
traced functions are the functions themselves: nothing is added to any call.

    CHATTTS_VELOCITY_TIMELINE=/tmp/tl chattts-velocity serve --dummy --fronts 4 ...
    python -m chattts_velocity.timeline /tmp/tl          # every process's spans: count, total, mean, longest
    python -m chattts_velocity.timeline /tmp/tl -o all.json   # ... and one trace of all of them
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import gc
import inspect
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

ENV = "CHATTTS_VELOCITY_TIMELINE"
ENV_EVENTS = "CHATTTS_VELOCITY_TIMELINE_EVENTS"
DEFAULT_EVENTS = 200_000


def _now_us() -> float:
    """Microseconds on the monotonic clock, which every process of the machine shares."""
    return time.monotonic_ns() / 1000.0


class Timeline:
    """Spans of one process's threads, kept in memory up to ``max_events`` and written to ``folder`` once."""

    def __init__(self, folder: str | os.PathLike, max_events: int = DEFAULT_EVENTS):
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events!r}")
        self.folder, self.max_events = Path(folder), max_events
        self._events: list[tuple[str, float, float, int, dict | None]] = []
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()
        self._written: Path | None = None
        self._gc_start: dict[int, float] = {}
        self._inside = threading.local()  # .busy: this thread holds ``_lock`` (see ``gc_phase``)

    @property
    def full(self) -> bool:
        return len(self._events) >= self.max_events

    def add(self, name: str, start_us: float, end_us: float, args: dict | None = None) -> None:
        """Record a span of the calling thread; the last one that fits writes the file."""
        thread = threading.current_thread()
        with self._locked():
            if self._written is not None or len(self._events) >= self.max_events:
                return
            self._threads.setdefault(thread.ident, thread.name)
            self._events.append((name, start_us, end_us, thread.ident, args))
            full = len(self._events) >= self.max_events
        if full:
            self.write()

    @contextlib.contextmanager
    def _locked(self):
        """``_lock``, with the thread marked as holding it: a collection that starts inside (any allocation may
        start one) calls ``gc_phase`` on this thread, which must not wait for the lock it holds."""
        with self._lock:
            self._inside.busy = True
            try:
                yield
            finally:
                self._inside.busy = False

    def gc_phase(self, phase: str, info: dict) -> None:
        """A ``gc.callbacks`` hook: each collection as a span (not one that ran inside the timeline's own
        bookkeeping, whose lock this thread holds)."""
        if getattr(self._inside, "busy", False):
            return
        ident = threading.get_ident()
        if phase == "start":
            self._gc_start[ident] = _now_us()
        elif (start := self._gc_start.pop(ident, None)) is not None:
            self.add("gc", start, _now_us(), {"generation": info.get("generation"),
                                                 "collected": info.get("collected")})

    def write(self) -> Path | None:
        """Write the spans so far as a Chrome trace (once; later calls return the same path). None if no span
        was recorded."""
        with self._locked():
            if self._written is not None or not self._events:
                return self._written
            pid = os.getpid()
            self.folder.mkdir(parents=True, exist_ok=True)
            process = multiprocessing.current_process().name
            path = self.folder / f"{process}-{pid}.json"
            events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}}]
            events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                       for tid, name in self._threads.items()]
            for name, start, end, tid, args in self._events:
                event = {"name": name, "ph": "X", "ts": start, "dur": max(end - start, 0.0), "pid": pid, "tid": tid}
                if args:
                    event["args"] = args
                events.append(event)
            path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
            self._written = path
            self._events = []
            return path


def _from_env() -> Timeline | None:
    folder = os.environ.get(ENV)
    if not folder:
        return None
    try:
        max_events = int(os.environ.get(ENV_EVENTS, DEFAULT_EVENTS))
    except ValueError:
        raise ValueError(f"{ENV_EVENTS} must be an int, got {os.environ[ENV_EVENTS]!r}") from None
    timeline = Timeline(folder, max_events)
    gc.callbacks.append(timeline.gc_phase)
    atexit.register(timeline.write)
    return timeline


ACTIVE: Timeline | None = _from_env()
"""This process's timeline, if ``CHATTTS_VELOCITY_TIMELINE`` was set when it started."""


def traced(name: str, describe: Callable[..., dict] | None = None):
    """Decorate a function (or coroutine function) to record each call as a span named ``name``, with
    ``describe(args, kwargs, result)`` (a dict, or None) as its arguments. Without an active timeline the
    function itself is returned."""

    def wrap(fn):
        timeline = ACTIVE
        if timeline is None:
            return fn

        def record(start: float, args, kwargs, result) -> None:
            if timeline.full:
                return
            try:
                extra = describe(args, kwargs, result) if describe is not None else None
            except Exception as e:  # noqa: BLE001 - a description that fails is recorded as such
                extra = {"describe failed": repr(e)}
            timeline.add(name, start, _now_us(), extra)

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def traced_coroutine(*args, **kwargs):
                start = _now_us()
                result = await fn(*args, **kwargs)
                record(start, args, kwargs, result)
                return result

            return traced_coroutine

        @functools.wraps(fn)
        def traced_call(*args, **kwargs):
            start = _now_us()
            result = fn(*args, **kwargs)
            record(start, args, kwargs, result)
            return result

        return traced_call

    return wrap


# ---------------------------------------------------------------------------- reading
def load(folder: str | os.PathLike) -> list[dict]:
    """Every event of every trace file in ``folder``."""
    events = []
    for path in sorted(Path(folder).glob("*.json")):
        events += json.loads(path.read_text())["traceEvents"]
    return events


def summary(events: list[dict]) -> list[tuple[str, str, int, float, float, float]]:
    """(process, span name, count, total ms, mean ms, longest ms) of each process's spans, the longest total
    first."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    spans: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault((processes.get(e["pid"], str(e["pid"])), e["name"]), []).append(e["dur"] / 1000.0)
    rows = [(process, name, len(d), sum(d), sum(d) / len(d), max(d)) for (process, name), d in spans.items()]
    return sorted(rows, key=lambda row: -row[3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chattts_velocity.timeline",
                                     description="Summarise the trace files a timeline wrote (and merge them).")
    parser.add_argument("folder", help=f"the folder {ENV} named")
    parser.add_argument("-o", "--output", help="write every process's events into this one trace file")
    args = parser.parse_args(argv)
    events = load(args.folder)
    if not events:
        parser.error(f"no trace files in {args.folder}")
    if args.output:
        Path(args.output).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    print(f"{'process':<24} {'span':<34} {'count':>7} {'total ms':>10} {'mean ms':>9} {'longest ms':>10}")
    for process, name, count, total, mean, longest in summary(events):
        print(f"{process[:24]:<24} {name[:34]:<34} {count:>7} {total:>10.1f} {mean:>9.3f} {longest:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
