"""``AsyncLLMEngine``: one engine shared by many callers. A background thread owns the ``LLMEngine`` and steps it
while there is work (it sleeps on a condition when idle); any thread submits requests and reads their outputs
from a ``RequestStream``, synchronously or with ``async for``. Nobody else calls ``LLMEngine.step``.

Requests are validated on the caller's thread (a bad one raises there and never reaches the engine); adds and
aborts are handed to the engine thread, which applies them before its next step, so an abort frees the
request's blocks within one step. A failed request's stream raises ``RequestError``; the others go on."""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import torch

from ..device import device_wait_s
from ..timeline import traced
from .engine_config import EngineConfig
from .llm_engine import EngineStats, LLMEngine
from .request_stream import RequestStream, RequestTimes
from .sampling_params import SamplingParams
from .sequence import FinishReason, Prompt, RequestOutput, Sequence
from .timings import THREAD_PARTS, Timings

logger = logging.getLogger(__name__)

_RECENT = 1024
"""Finished requests whose timestamps ``stats`` still reports."""

_LATE_AUDIO_S = 10.0
"""How long a streamed request that finished before its first audio may still get it (its listener's round runs
on a thread of its own: ``AudioPump.thread``) and be timed (``first_audio_wait``)."""


STALL_S = 60.0
"""Work for this long without a finished step is a stall (``check_health``'s default: a hung device call)."""
WATCH_S = 5.0
"""How often a watcher thread asks ``check_health`` while the engine thread runs, so a stall is logged (with
where the engine thread waits) even where nobody probes the engine's health."""


class EngineShutdownError(RuntimeError):
    """The engine was shut down: it takes no new requests."""


@dataclass(frozen=True)
class AsyncStats:
    """``LLMEngine.stats`` after the latest step, plus the requests' timestamps (live and recently finished)."""

    engine: EngineStats
    num_requests: int
    """Requests submitted so far."""
    requests: dict[str, RequestTimes] = field(default_factory=dict)


class AsyncLLMEngine:
    """Owns an ``LLMEngine`` on a background thread (started with the first request)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        engine.arrivals = self._take_pending
        self._lock = threading.Condition()
        self._new: list[tuple[Sequence, RequestStream]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}
        self._recent: deque[tuple[str, RequestTimes]] = deque(maxlen=_RECENT)
        self._stats = engine.stats()
        self._num_requests = 0
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain = True
        self._idle = True
        """No request queued, running or being aborted (updated by the engine thread)."""
        self._beat = time.monotonic()
        """When the engine thread last finished a step or woke up to work (``check_health``)."""
        self._stall_logged: float | None = None  # ``_beat`` of the last stall logged (one log line a stall)
        self.watch_s, self.watch_stall_s = WATCH_S, STALL_S
        """The watcher's period and the stall it logs (``WATCH_S``, ``STALL_S``)."""
        self.device_streams: dict[str, object] = {}
        """CUDA streams a stall's log says are idle or still running work, by what runs on them (the engine's
        own, from its thread's start; the wav decode's, from ``Pipeline``): one still running while the engine
        thread waits is work the device itself never finished."""
        self._abort_asked: dict[str, float] = {}  # request id -> when its abort was asked
        self._abort_wait = Timings()
        self._loop_time = Timings()
        self._first_token_wait = Timings()
        self._first_audio_wait = Timings()
        self._first_decode_wait = Timings()
        self._thread_time = dict.fromkeys(THREAD_PARTS, 0.0)  # the engine thread's (``EngineStats.thread_time``)
        self._young: dict[str, RequestTimes] = {}
        """Requests with a first token and no first audio yet (engine thread): ``_first_audio_wait``."""
        self._late: dict[str, float] = {}
        """Those of ``_young`` that finished while their listener's round may still bring their first audio (a
        listener whose rounds run on a thread of its own: ``AudioPump.thread``), and when (``_LATE_AUDIO_S``)."""
        _ENGINES.add(self)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def config(self) -> EngineConfig:
        """The engine's settings (``EngineConfig``)."""
        return self.engine.config

    @property
    def kv_capacity(self) -> int:
        """Tokens the whole KV cache holds (``LLMEngine.kv_capacity``)."""
        return self.engine.kv_capacity

    # ---------------------------------------------------------------- any thread
    def add_requests(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams],
                     request_ids: list[str] | None = None) -> RequestStream:
        """Validate every request (``ValueError`` naming the first bad one; nothing is queued then) and queue
        them all; one stream yields their outputs."""
        return self.submit(self.make_sequences(prompts, params, request_ids))

    def make_sequences(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams],
                       request_ids: list[str] | None = None) -> list[Sequence]:
        """Validate requests and build their sequences without queueing them (``submit`` queues them later:
        a caller that feeds requests in gradually validates them all up front, once)."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts) or (request_ids is not None and len(request_ids) != len(prompts)):
            raise ValueError(f"got {len(prompts)} prompts, {len(params)} SamplingParams and "
                             f"{len(request_ids or prompts)} request ids: give one of each per prompt")
        if request_ids is None:
            request_ids = [f"req-{next(self._ids)}" for _ in prompts]
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request ids must be unique")
        seqs = []
        for i, (rid, prompt, p) in enumerate(zip(request_ids, prompts, params, strict=True)):
            try:
                seqs.append(self.engine.make_sequence(rid, prompt, p))
            except ValueError as e:
                raise ValueError(f"request {i}: {e}" if len(prompts) > 1 else str(e)) from None
        return seqs

    def submit(self, seqs: list[Sequence]) -> RequestStream:
        """Queue sequences from ``make_sequences``; one stream yields their outputs."""
        request_ids = [seq.request_id for seq in seqs]
        stream = RequestStream(self, request_ids)
        with self._lock:
            if self._stopping:
                raise EngineShutdownError("the engine is shut down: it takes no new requests")
            clash = next((rid for rid in request_ids if rid in self._streams), None)
            if clash is not None:
                raise ValueError(f"request_id {clash!r} is already in use")
            self._streams.update(dict.fromkeys(request_ids, stream))
            self._new.extend((seq, stream) for seq in seqs)
            self._num_requests += len(seqs)
            self._start()
            self._lock.notify()
        return stream

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> RequestStream:
        return self.add_requests([prompt], [params], None if request_id is None else [request_id])

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """``async for out in engine.generate(...)``: one request's outputs. Cancelling the task or leaving the
        loop early aborts the request."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its stream ends with finish reason ``abort``."""
        with self._lock:
            self._aborts.append(request_id)
            self._abort_asked.setdefault(request_id, time.monotonic())
            self._lock.notify()

    def set_backlog(self, backlog: Callable[[], bool] | None) -> None:
        """Tell the scheduler how to see requests waiting outside the engine for a running slot (a server's
        admission queue): while one does, decode windows run whole (``Scheduler.backlog``). Any thread."""
        self.engine.scheduler.backlog = backlog

    def stats(self) -> AsyncStats:
        with self._lock:
            requests = dict(self._recent)
            for rid, stream in self._streams.items():
                requests[rid] = stream.times[rid]
            engine = replace(self._stats, abort_wait=self._abort_wait.copy(), loop_time=self._loop_time.copy(),
                             first_token_wait=self._first_token_wait.copy(),
                             first_audio_wait=self._first_audio_wait.copy(),
                             first_decode_wait=self._first_decode_wait.copy(), thread_time=dict(self._thread_time))
            return AsyncStats(engine=engine, num_requests=self._num_requests, requests=requests)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every request finished and every abort was applied (blocks freed); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._idle and not (self._new or self._aborts), timeout)

    def check_health(self, stall_s: float = STALL_S) -> None:
        """Raise ``RuntimeError`` if the engine cannot serve: shut down, its thread died, or it has had work for
        ``stall_s`` seconds without finishing a step (a hung device call). Cheap enough for a health probe."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is shut down")
            thread, beat, busy = self._thread, self._beat, not self._idle
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the engine thread died (the log has its traceback)")
        if busy and time.monotonic() - beat > stall_s:
            self._log_stall(thread, beat, stall_s)
            raise RuntimeError(f"the engine has had work for over {stall_s:g} s without finishing a step")

    def _log_stall(self, thread: threading.Thread | None, beat: float, stall_s: float) -> None:
        """Log, once a stall, where the engine thread is (a hung device call shows as the wait it hangs in)."""
        with self._lock:
            if self._stall_logged == beat:
                return
            self._stall_logged = beat
        frame = sys._current_frames().get(thread.ident) if thread is not None else None
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(its stack is not available)\n"
        streams = "".join(f"\n{name} CUDA stream: {'idle' if stream.query() else 'still running work'}"
                          for name, stream in list(self.device_streams.items()))
        logger.error("the engine has had work for over %g s without finishing a step; its thread is at:\n%s%s",
                     stall_s, where.rstrip(), streams)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new requests; with ``drain`` finish the queued and running ones, else abort them. Waits up
        to ``timeout`` seconds for the engine thread."""
        with self._lock:
            self._stopping, self._drain = True, drain
            if not drain:
                self._aborts.extend(self._streams)
            self._lock.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ---------------------------------------------------------------- the engine thread
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="chattts-velocity-engine", daemon=True)
            self._thread.start()
            threading.Thread(target=self._watch, args=(self._thread,), name="chattts-velocity-engine-watch",
                             daemon=True).start()

    def _watch(self, thread: threading.Thread) -> None:
        """While ``thread`` (the engine thread) runs, ask ``check_health`` every ``watch_s``: it logs a stall."""
        while True:
            thread.join(self.watch_s)
            if not thread.is_alive():
                return
            try:
                self.check_health(self.watch_stall_s)
            except RuntimeError:  # logged there (a stall), or the engine is stopping
                pass

    def _run(self) -> None:
        # The engine's device work goes on a stream of its own: on the legacy default stream, other threads'
        # GPU work (the stream decodes) was serialised behind its windows (docs/perf/).
        device = self.engine.runner.device
        if device.type != "cuda":
            self._loop()
            return
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.default_stream(device))  # the cache and buffers built at construction
        self.device_streams["the engine's"] = stream
        with torch.cuda.stream(stream):
            self._loop()

    def _loop(self) -> None:
        engine, spent = self.engine, self._thread_time
        while True:
            with self._lock:
                self._idle = not engine.has_unfinished_requests()
                if self._idle:
                    self._lock.notify_all()
                waited = time.perf_counter()
                while not (self._new or self._aborts or engine.has_unfinished_requests() or self._stopping):
                    self._lock.wait()
                spent["idle"] += time.perf_counter() - waited
                if self._stopping and not (self._new or self._aborts or engine.has_unfinished_requests()):
                    self._lock.notify_all()
                    return
                if self._idle:
                    self._beat = time.monotonic()
                self._idle = False
            turn, clock, device = time.monotonic(), time.perf_counter(), device_wait_s()
            self._take_pending()
            try:
                outputs = engine.step()
            except Exception as err:  # noqa: BLE001 - the engine failed outside any one batch: fail everyone
                logger.exception("engine step failed; failing every request")
                outputs = self._fail_all(err)
            clock, device = self._spent("step", clock, device)
            self._dispatch(outputs)
            self._spent("deliver", clock, device)
            self._loop_time.observe(time.monotonic() - turn)

    def _spent(self, part: str, clock: float, device: float) -> tuple[float, float]:
        """Add the time since ``clock`` (``perf_counter``) to ``part`` of ``_thread_time``, the device waits
        since ``device`` (``device_wait_s``) to its ``_device_wait``; the clocks now."""
        now, waits = time.perf_counter(), device_wait_s()
        self._thread_time[part] += now - clock - (waits - device)
        self._thread_time[part + "_device_wait"] += waits - device
        return now, waits

    @traced("hand over outputs", lambda a, k, r: {"outputs": len(a[1])})
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        with self._lock:
            self._stats = self.engine.stats()
            self._beat = now
            streams = [self._streams.get(out.request_id) for out in outputs]
            for out in outputs:
                if out.finished and out.request_id in self._streams:
                    stream = self._streams.pop(out.request_id)
                    self._recent.append((out.request_id, stream.times[out.request_id]))
        ended = []  # young requests that finished: forgotten after the audio round, if it gave them none
        for out, stream in zip(outputs, streams, strict=True):
            if stream is not None:
                times = stream.times[out.request_id]
                first = times.first_token is None
                stream.deliver(out, now)
                if first and times.first_token is not None:
                    self._first_token_wait.observe(times.first_token - times.queued)
                    self._young[out.request_id] = times
            if out.finished and out.request_id in self._young:
                # its first audio may still come where the listener's rounds run on a thread of their own
                ended.append((out.request_id, getattr(stream and stream.listener, "thread", False)))
        # the listeners in order, each once (keyed by themselves, not ``id()``: see ``AudioPump._feeds``)
        listeners = dict.fromkeys(s.listener for s in streams if s is not None and s.listener)
        hurry = False
        if listeners:  # the next step, if it leads to first audio, computes on the device during the round
            self._take_pending()
            hurry = self.engine.scheduler.before_first_audio()
            try:
                self.engine.launch_ahead(hurry)
            except Exception:  # noqa: BLE001 - (it reports its own failures to the next step) the loop goes on
                logger.exception("launching the next step ahead failed")
        for listener in listeners:
            # once per step: the audio of every stream of this step is decoded in one round, a short one while a
            # request waits for the next step on its way to first audio (its prefill or first window)
            listener.wake(hurry=hurry)
        if self._young:
            self._heard(ended, now)

    def _heard(self, ended: list[tuple[str, bool]], now: float) -> None:
        """Time the first audio of the young requests that have it now; forget those of ``ended`` (request id,
        whether a later round may bring its first audio) without: at once where none can (text requests, audio
        decoded whole at the end, rounds between the steps, which ran before this), else after
        ``_LATE_AUDIO_S``."""
        heard = [(rid, t) for rid, t in self._young.items() if t.first_audio is not None]
        for rid, times in heard:
            del self._young[rid]
            self._late.pop(rid, None)
            self._first_audio_wait.observe(times.first_audio - times.first_token)
            if times.audio_ready is not None:
                self._first_decode_wait.observe(times.first_audio - times.audio_ready)
        for rid, listened in ended:
            if listened:
                self._late[rid] = now
            else:
                self._young.pop(rid, None)
        for rid in [rid for rid, at in self._late.items() if now - at > _LATE_AUDIO_S]:
            del self._late[rid]
            self._young.pop(rid, None)

    def _take_pending(self) -> bool:
        """Hand the requests submitted and aborted since the last step to the engine; whether there were any
        (``LLMEngine.arrivals``, which the engine calls between two decode windows)."""
        if not (self._new or self._aborts):  # (read without the lock: a miss is taken at the next call)
            return False
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            asked = [self._abort_asked.pop(rid, None) for rid in aborts]
        for seq, _ in new:
            self.engine.add_sequence(seq)
        for rid in aborts:
            self.engine.abort_request(rid)
        if aborts:  # (most turns have none: no clock read for them)
            now = time.monotonic()
            for t in asked:
                if t is not None:
                    self._abort_wait.observe(now - t)
        return bool(new or aborts)

    def _fail_all(self, err: Exception) -> list[RequestOutput]:
        outputs = []
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid, report=False)
            outputs.append(RequestOutput(rid, new_token_ids=torch.empty(0, dtype=torch.int64), new_hidden_states=None,
                                         num_generated=0, finished=True, finish_reason=FinishReason.ERROR, error=err))
        return outputs


_ENGINES: weakref.WeakSet[AsyncLLMEngine] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At exit, stop engine threads before the interpreter (and torch) tear down under them."""
    for engine in list(_ENGINES):
        engine.shutdown(drain=False, timeout=5)
