"""``AudioPump``: the audio of every streaming request, decoded in batched rounds between the engine's steps.

A consumer (a thread streaming one ``infer`` call, a server request) opens a ``Feed`` on its ``RequestStream``
and reads ``Delivery`` objects from it. The engine thread marks a stream when it hands it outputs, and after
each step it runs one round (``wake``; paced, see ``AudioPump``): the new tokens of every marked stream are pushed into their decoders,
every window they complete is decoded in one batched Decoder + Vocos call per window length, and each feed gets
its samples. Under load the windows of hundreds of streams share one call (on a GPU a batch of windows costs
little more than one window); the consumers only wait on their own queue.

Where the rounds run: by default on the engine's thread, between its steps, where each round costs its own time
and nothing else. An eager window decode launches a few hundred kernels from Python, and run beside the engine
on a thread of its own it traded the GIL with the engine: both took several times longer (`chattts-velocity
bench stream`; docs/perf/). With the decodes replayed as CUDA graphs (``AudioDecoder.use_graphs``) a round is
mostly a wait for the device, and ``AudioPump(thread=True)`` runs the rounds on a thread of the pump's own:
``wake`` only signals it, the engine's next step runs while a round decodes, and a round takes the outputs of
every step since the one before. What a round decodes, and when (first audio, deadlines, pacing):
``AudioPump``."""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from ..timeline import traced
from .deadlines import BURST_CHUNKS, PLAYBACK_GUARD_S, Pace, deadline, safe_to_start
from .decode import AudioDecoder
from .stream import AudioStream, StreamConfig, Window, decode_windows

logger = logging.getLogger(__name__)


@dataclass
class Delivery:
    """What one pump round produced for one feed."""

    outputs: list
    """The engine outputs (``RequestOutput``) taken in this round, in order."""
    samples: dict[str, list[np.ndarray]] = field(default_factory=dict)
    """New samples per request id, in order (float32, 1-D)."""
    done: frozenset[str] = frozenset()
    """Requests whose audio is complete (finished, and every sample delivered)."""


_END = object()

WORKER_IDLE_S = 30.0
"""How long the pump's thread (``AudioPump.thread``) waits for a wake before it ends (the next wake starts
another)."""


class _Pending:
    def __repr__(self) -> str:
        return "PENDING"


PENDING = _Pending()
"""What a feed with a ``notify`` callback (and every iterator over one) yields when nothing is there yet, instead
of waiting: its reader comes back after the next ``notify``."""


def take_ready(audio) -> tuple[np.ndarray | None, bool, Exception | None]:
    """Read a non-blocking audio iterator (one that yields ``PENDING``) up to its ``PENDING``: every chunk there
    now as one array (None if none), whether it ended, and the error it raised (once the chunks before it are
    taken: the caller hands those out first)."""
    parts, end, failure = [], False, None
    try:
        while (chunk := next(audio)) is not PENDING:
            parts.append(chunk)
    except StopIteration:
        end = True
    except Exception as err:  # noqa: BLE001 - the caller reports it after the audio before it
        end, failure = True, err
    return (np.concatenate(parts) if len(parts) > 1 else parts[0]) if parts else None, end, failure


class Feed:
    """One ``RequestStream``'s requests turned into audio: iterate for ``Delivery`` objects until every request's
    audio is out (or the stream was closed); a failed request or decode raises there. ``close`` (or leaving a
    ``with`` block) stops the deliveries; it does not close the stream.

    Without ``notify`` iteration blocks until the next delivery (a reader thread per feed). With it, iteration
    never blocks: it yields ``PENDING`` when nothing is there, and ``notify()`` is called (on the pump's thread)
    after each new item, so one event loop can read many feeds without a thread each.

    ``every_round``: a delivery for every round that took outputs of the stream, audio or not (a progress bar
    moves with each); False: outputs without audio wait for the feed's next audio, a finished request or its
    end, so a reader that wants only audio is not woken (nor its ``notify`` called) for nothing."""

    def __init__(self, pump: AudioPump, stream, config: StreamConfig, use_decoder: bool, notify=None,
                 every_round: bool = True):
        self.pump, self.stream, self.use_decoder, self.notify = pump, stream, use_decoder, notify
        self.config = config
        self.every_round = every_round
        self.audio = {rid: AudioStream(config) for rid in stream.request_ids}
        self.owner = {a: rid for rid, a in self.audio.items()}
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self._outputs: list = []  # taken from the stream, not yet delivered
        self._windows: list[Window] = []  # planned, not yet decoded (a round put them off)
        self.started: dict[str, float] = {}
        """Request id -> when its first audio was sent (the pump's clock): its listener plays from then on."""

    def __iter__(self):
        while True:
            if self.notify is None:
                item = self._out.get()
            else:
                try:
                    item = self._out.get_nowait()
                except queue.Empty:
                    yield PENDING
                    continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.closed = True
        self.pump._forget(self)

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- pump side
    def _take(self) -> None:
        """The stream's new outputs pushed into the decoders; every window they made decodable joins those not
        decoded yet."""
        outputs = self.stream.take()
        for out in outputs:
            tokens = out.new_hidden_states if self.use_decoder else out.new_token_ids
            if self.pump.thread:  # decoded while the engine allocates (see ``AudioDecoder.hold``)
                self.pump.audio.hold(tokens)
            self.audio[out.request_id].push(tokens, finished=out.finished)
        self._outputs += outputs
        ready = [w for a in self.audio.values() for w in a.ready()]
        for w in ready:
            if w.start == 0:  # its first audio's tokens are here: the rest of its way is the pump's
                self.stream.mark_audio_ready(self.owner[w.stream])
        self._windows += ready

    def deadline(self, rid: str) -> float | None:
        """When request ``rid``'s listener, playing since its first audio, runs out of the audio sent so far
        (None before its first audio)."""
        return deadline(self.started.get(rid), self.audio[rid].emitted)

    def _unstarted(self) -> dict[str, list[Window]]:
        """The waiting windows of each request whose first audio is not sent yet (those with any)."""
        out: dict[str, list[Window]] = {}
        if len(self.started) < len(self.audio):
            for w in self._windows:
                if (rid := self.owner[w.stream]) not in self.started:
                    out.setdefault(rid, []).append(w)
        return out

    def _ready(self, unstarted: dict[str, list[Window]], gap_s: float, starting: int, known: bool) -> list[Window]:
        """The windows a round may decode now, taken out of those waiting: all but those of a request of
        ``unstarted`` (``_unstarted()``, or none) whose first audio is not yet safe to start on
        (``deadlines.safe_to_start``, ``known``: whether the pace knows the load; its last window always is)."""
        least = 0 if known or not unstarted else self.config.head_tokens(BURST_CHUNKS)
        held = {ws[0].stream for ws in unstarted.values() if not ws[-1].final
                and not safe_to_start(sum(w.end - w.start for w in ws), gap_s, starting, least)}
        ready = [w for w in self._windows if w.stream not in held]
        self._windows = [w for w in self._windows if w.stream in held]
        return ready

    def _due(self, windows: list[Window], horizon: float) -> bool:
        """A window of a request whose listener runs dry before ``horizon``."""
        return any((d := self.deadline(self.owner[w.stream])) is not None and d < horizon for w in windows)

    def _send(self, *items) -> None:
        """Queue ``items`` in order, then call ``notify`` once: a reader woken by it finds them all (a request's
        last samples and its feed's end go out together, not one reader's pass apart)."""
        if not self.closed:
            for item in items:
                self._out.put(item)
            if self.notify is not None:
                self.notify()


class AudioPump:
    """Decodes the stream windows of all open feeds in batched rounds between the engine's steps (see the
    module). In each round, on the pump's ``clock``:

    - a request's first audio and its last are decoded at once, the first audio in a call of its own ahead of
      the round's other windows (a first window's length is no later window's), so it never waits for theirs;
    - with ``safe_start``, a request's first audio waits until it outlasts the gap before the next round can
      bring more (``deadlines.safe_to_start``): at once on an engine far faster than real time; in a burst
      of new requests into a load no round since the pump began served, until it holds their first two chunks;
    - a full round (every feed's windows) comes at most every ``round_interval_s``, and not while a request
      waits for the engine's next step on its way to first audio (``wake(hurry=True)``), unless
    - with ``deadlines``, a window's listener would run dry before a later round could bring it (its
      ``Feed.deadline`` within this round, a step and a full round: ``deadlines.Pace``). That round is a full
      one: deadlines come in clumps (streams admitted together), a call costs about the same for one window
      as for many of its length, and each window decoded now is one the next rounds need not wait for.

    With neither option a round is as before both: paced, first and last windows in between, one call."""

    def __init__(self, audio: AudioDecoder, round_interval_s: float = 0.0, *, deadlines: bool = True,
                 safe_start: bool = True, thread: bool = False, clock=time.monotonic):
        if not round_interval_s >= 0:
            raise ValueError(f"round_interval_s must be >= 0, got {round_interval_s!r}")
        self.audio = audio
        self.round_interval_s = round_interval_s
        """Least time between two decoding rounds for windows that can wait (0: every engine step). Most of a
        decode call's cost is per call, whatever its number of windows (`chattts-velocity bench serve`;
        docs/perf/), so under load fewer, larger rounds leave the engine more of its time; a later chunk arrives
        up to this much later (never past its listener's deadline with ``deadlines``)."""
        self.deadlines, self.safe_start = deadlines, safe_start
        """The two rules of the class docstring (both off: the rounds as they were before them)."""
        self.thread = thread
        """Run the rounds on a thread of the pump's own, which ``wake`` signals (see the module); False: on the
        thread that calls ``wake``. May be changed between rounds."""
        self.clock = clock
        """Seconds, monotonic (``time.monotonic``; tests give a fake one)."""
        self._signal = threading.Condition()  # guards the three fields below
        self._woken = False  # a wake not yet served by the pump's thread
        self._woken_hurry = False  # ``hurry`` of the latest such wake
        self._worker: threading.Thread | None = None  # the pump's thread, while it runs
        self.pace = Pace()
        """The recent steps and full rounds: how long until the next round may bring more audio."""
        self._lock = threading.Lock()  # guards the three dicts below
        self._rounds = threading.Lock()  # one round at a time, on whichever thread runs it
        # (keyed by the objects themselves, hashed by identity: ``id()`` is an audited event, and an audit hook
        # that a library installs (filelock's, on Python 3.12) turns every call of it into a Python call)
        self._feeds: dict[object, Feed] = {}  # stream -> its feed
        self._marked: dict[object, None] = {}  # streams with news, in order
        self._deferred: dict[object, None] = {}  # streams with windows put off: marked at the next wake
        self._last_decode = float("-inf")
        self._round_since: float | None = None  # when the rounds of the wake in progress began (``clock``)
        self.num_calls = 0
        """Decode calls so far (one per decoder kind for each group of a round's windows)."""

    def open(self, stream, config: StreamConfig, use_decoder: bool, notify=None, every_round: bool = True) -> Feed:
        """Start turning ``stream``'s outputs into audio (outputs that arrived before are taken at once: on this
        thread, or with ``notify`` (a reader that must not block, see ``Feed``) on a thread of their own).
        ``every_round``: see ``Feed``."""
        feed = Feed(self, stream, config, use_decoder, notify, every_round)
        with self._lock:
            self._feeds[stream] = feed
        stream.listen(self)
        # outputs that came before ``listen`` marked nothing, and a ``close`` before it told nobody: take them
        # now (later outputs are marked and taken by the engine thread's round after their step)
        if stream.has_outputs() or stream.exhausted():
            self.mark(stream)
            if notify is None:
                self.wake()
            else:  # a round decodes: not on an event loop
                threading.Thread(target=self.wake, name="chattts-velocity-audio", daemon=True).start()
        return feed

    @traced("audio decode", lambda a, k, r: {"windows": len(a[1])})
    def decode(self, windows: list[Window], use_decoder: bool) -> list[np.ndarray]:
        """Each window's (2W - 1) * 256 samples, in order (``decode_windows``): one call."""
        self.num_calls += 1
        return decode_windows(self.audio, windows, use_decoder)

    # ---------------------------------------------------------------- RequestStream's listener protocol
    def mark(self, stream) -> None:
        """``stream`` has new outputs; the next ``wake`` takes them."""
        with self._lock:
            self._marked[stream] = None

    def closed(self, stream) -> None:
        """``stream`` was closed (from any thread, the server's event loop included): its reader's feed ends at
        once, without running a round on the caller's thread."""
        with self._lock:
            feed = self._feeds.pop(stream, None)
            self._marked.pop(stream, None)
            self._deferred.pop(stream, None)
        if feed is not None:
            feed._send(_END)

    def wake(self, hurry: bool = False) -> None:
        """Run rounds until no marked stream is left: the engine calls it after each step, and ``open`` for
        outputs that arrived before it. ``hurry``: a request waits for the engine's next step to reach its first
        audio, so only what cannot wait is decoded (see the class). With ``thread`` the rounds run on the pump's
        thread and this returns at once."""
        if not self.thread:
            self._wake(hurry)
            return
        with self._signal:
            self._woken = True
            self._woken_hurry = hurry
            if self._worker is None or not self._worker.is_alive():  # (one that died is replaced)
                self._worker = threading.Thread(target=self._work, name="chattts-velocity-audio", daemon=True)
                self._worker.start()
                _THREADED.add(self)
            self._signal.notify()

    def check_health(self, stall_s: float) -> None:
        """Raise ``RuntimeError`` if a wake's rounds have run for over ``stall_s`` seconds (a decode that hangs,
        on the pump's thread, where the engine's own check does not see it). Cheap enough for a health probe."""
        since = self._round_since
        if since is not None and self.clock() - since > stall_s:
            raise RuntimeError(f"an audio decode round has run for over {stall_s:g} s")

    def stop_thread(self, timeout: float | None = None) -> None:
        """From now on run the rounds on the waking thread (``thread`` off); the pump's thread, if it runs,
        finishes the round it is in and ends. Waits up to ``timeout`` seconds for it."""
        with self._signal:
            self.thread = False
            worker = self._worker
            self._signal.notify()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)

    def _work(self) -> None:
        """The pump's thread: a wake's rounds each time one came; it ends after ``WORKER_IDLE_S`` without."""
        device = self.audio.device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            while True:
                with self._signal:
                    self._signal.wait_for(lambda: self._woken or not self.thread, WORKER_IDLE_S)
                    if not self._woken:  # idle, or ``stop_thread`` (a wake before it is served first)
                        if self._worker is threading.current_thread():  # (not a later one that replaced it)
                            self._worker = None
                        return
                    self._woken = False
                    hurry = self._woken_hurry
                self._wake(hurry)

    def _wake(self, hurry: bool) -> None:
        with self._rounds:
            self._round_since = self.clock()
            try:
                self._rounds_of_wake(hurry)
            finally:
                self._round_since = None

    def _rounds_of_wake(self, hurry: bool) -> None:
        """A wake's rounds, until no marked stream is left or a round puts off what it has."""
        self.pace.woke(self.clock())
        with self._lock:
            self._marked.update(self._deferred)
            self._deferred = {}
        while True:
            with self._lock:
                feeds = [self._feeds[key] for key in self._marked if key in self._feeds]
                self._marked = {}
            if not feeds:
                break
            try:
                with self.audio.stream():
                    if not self._round(feeds, hurry):
                        break  # put off until the wake after the next step
            except Exception as err:  # noqa: BLE001 - a bug here must reach the callers, not the engine
                logger.exception("audio round failed")
                for feed in feeds:
                    self._fail(feed, err)
        with self._lock:
            busy = bool(self._feeds)
        self.pace.rested(self.clock() if busy else None)

    # ---------------------------------------------------------------- rounds
    def _forget(self, feed: Feed) -> None:
        feed.stream.listen(None)
        with self._lock:
            if self._feeds.get(feed.stream) is feed:
                del self._feeds[feed.stream]

    @traced("audio round", lambda a, k, r: {"feeds": len(a[1]), "hurry": a[2], "took": r})
    def _round(self, feeds: list[Feed], hurry: bool) -> bool:
        """Take the feeds' news; decode and deliver what this round takes (see the class), the rest stays marked;
        False when it takes nothing (put off)."""
        now = self.clock()
        live: list[Feed] = []
        for feed in feeds:
            if feed.closed:
                continue
            try:
                feed._take()
            except Exception as err:  # noqa: BLE001 - a failed request (RequestError), or bad tokens
                self._fail(feed, err)
                continue
            live.append(feed)
        with self._lock:
            feeds_open = len(self._feeds)
        gap = self.pace.gap_s(feeds_open)
        unstarted = {feed: feed._unstarted() if self.safe_start else {} for feed in live}
        starting = sum(map(len, unstarted.values()))
        known = self.pace.knows(feeds_open)
        ready = {feed: feed._ready(unstarted[feed], gap, starting, known) for feed in live}
        paced = now - self._last_decode < self.round_interval_s
        full = not paced and not (hurry and self.deadlines)
        if self.deadlines and not full:  # due: would run dry before this round, a step and a full round more
            horizon = now + self.pace.round_s(feeds_open) + gap + PLAYBACK_GUARD_S
            full = any(feed._due(ready[feed], horizon) for feed in live)
        urgent = {feed for feed in live if not full and _urgent(feed, ready[feed])}
        taken = [feed for feed in live if full or feed in urgent]
        self._put_off([] if full else [feed for feed in live if feed not in urgent], ready)
        if not taken:
            return False
        decodes = any(ready[feed] for feed in taken)
        if full and decodes:
            self._last_decode = now
        first = {f for f in taken if self.deadlines and any(w.start == 0 for w in ready[f])}
        for group in ([f for f in taken if f in first], [f for f in taken if f not in first]):
            if group:
                self._deliver([(feed, ready[feed]) for feed in group])
        if full and decodes:
            self.pace.round_took(self.clock() - now, sum(bool(ready[feed]) for feed in taken), feeds_open)
        return True

    def _put_off(self, feeds: list[Feed], ready: dict[Feed, list[Window]]) -> None:
        """The windows this round does not take wait (with any held ones): a feed with windows put off is looked
        at again in the next wake, one without waits for its stream's next output (its outputs go out with its
        next delivery). Neither is looked at again in this wake, which would find them as they are."""
        for feed in feeds:
            feed._windows = ready[feed] + feed._windows
        with self._lock:
            for feed in feeds:
                if ready[feed] and feed.stream in self._feeds:
                    self._deferred[feed.stream] = None

    @traced("audio delivery", lambda a, k, r: {"feeds": len(a[1]), "windows": sum(len(w) for _, w in a[1])})
    def _deliver(self, taken: list[tuple[Feed, list[Window]]]) -> None:
        """Decode the feeds' windows (one call per decoder kind, ``decode_windows`` batching equal lengths) and
        send each feed its outputs, samples and end."""
        wavs: dict[Window, np.ndarray] = {}  # window -> its samples
        failed: dict[Feed, BaseException] = {}  # feed -> the decode error
        for use_decoder in (True, False):
            group = [(feed, w) for feed, windows in taken if feed.use_decoder is use_decoder for w in windows]
            if not group:
                continue
            try:
                decoded = self.decode([w for _, w in group], use_decoder)
            except Exception as err:  # noqa: BLE001 - every feed of the call sees the failure
                for feed, _ in group:
                    failed[feed] = err
                continue
            for (_, window), wav in zip(group, decoded, strict=True):
                wavs[window] = wav
        sends: list[tuple[Feed, list]] = []  # sent once decoded: a woken reader competes for the GIL
        now = self.clock()
        for feed, windows in taken:
            outputs, feed._outputs = feed._outputs, []
            if feed in failed:
                sends.append((feed, [failed[feed]]))
                continue
            items = []
            delivery = Delivery(outputs)
            for window in windows:
                rid = feed.owner[window.stream]
                delivery.samples.setdefault(rid, []).append(window.stream.accept(window, wavs[window]))
                feed.started.setdefault(rid, now)
                feed.stream.mark_first_audio(rid)
            delivery.done = frozenset(rid for rid, a in feed.audio.items() if a.done)
            if delivery.samples or (outputs and (feed.every_round or delivery.done
                                                 or any(out.finished for out in outputs))):
                items.append(delivery)
            else:  # (see ``Feed.every_round``) they go out with the feed's next delivery
                feed._outputs = outputs
            if feed.stream.exhausted():
                items.append(_END)
            elif feed.stream.has_outputs():  # it stopped before a failed request's output: take that next
                self.mark(feed.stream)
            if items:
                sends.append((feed, items))
        for feed, items in sends:
            if items[-1] is _END or isinstance(items[-1], BaseException):
                self._forget(feed)
            feed._send(*items)

    def _fail(self, feed: Feed, err: BaseException) -> None:
        feed._send(err)
        self._forget(feed)


def _urgent(feed: Feed, ready: list[Window]) -> bool:
    """A window that cannot wait for the next full round: a request's first audio, or its last."""
    return any(w.start == 0 or w.final for w in ready) or feed.stream.exhausted()


_THREADED: weakref.WeakSet[AudioPump] = weakref.WeakSet()
"""Pumps whose thread was started."""


@atexit.register
def _stop_threads() -> None:
    """At exit, end the pumps' threads before the interpreter (and torch) tear down under a round."""
    for pump in list(_THREADED):
        pump.stop_thread(timeout=5)
