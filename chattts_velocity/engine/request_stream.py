"""``RequestStream``: what a caller holds for its requests: their outputs in the order the engine produced them,
read synchronously or with ``async for``, and the timestamps of each request's milestones."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

from .sequence import FinishReason, RequestOutput


class RequestError(RuntimeError):
    """A request failed inside the engine (its ``__cause__`` is the original error)."""


@dataclass
class RequestTimes:
    """Wall-clock (``time.monotonic``) milestones of one request."""

    queued: float
    first_token: float | None = None
    audio_ready: float | None = None
    """When the tokens of its first audio reached whoever turns them into audio, its first window decodable
    (``RequestStream.mark_audio_ready``): from here to ``first_audio`` the way is theirs (an audio pump's hold
    for a safe start, the decode)."""
    first_audio: float | None = None
    """Set by whoever turns tokens into audio (``RequestStream.mark_first_audio``)."""
    finished: float | None = None
    finish_reason: FinishReason | None = None


class Aborter(Protocol):
    """What a stream asks to abort its requests (``AsyncLLMEngine``)."""

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one or more requests, in the order the engine produced them. Iterating (``for`` or
    ``async for``) yields ``RequestOutput`` objects until every request finished; a failed request raises
    ``RequestError`` there. ``close`` (or leaving a ``with`` block, or an abandoned ``async for`` in
    ``AsyncLLMEngine.generate``) aborts the requests that are still running."""

    def __init__(self, engine: Aborter, request_ids: list[str]):
        self._engine = engine
        self.request_ids = tuple(request_ids)
        self.times = {rid: RequestTimes(queued=time.monotonic()) for rid in request_ids}
        self._pending = set(request_ids)
        self._items: deque[RequestOutput] = deque()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._listener = None
        """Told of every output and of ``close`` (``listen``): an ``AudioPump``."""

    @property
    def listener(self):
        """What ``listen`` set (None: nobody)."""
        return self._listener

    def mark_audio_ready(self, request_id: str) -> None:
        times = self.times[request_id]
        if times.audio_ready is None:
            times.audio_ready = time.monotonic()

    def mark_first_audio(self, request_id: str) -> None:
        times = self.times[request_id]
        if times.first_audio is None:
            times.first_audio = time.monotonic()

    def abort(self) -> None:
        """Abort the requests that have not finished; their final outputs (finish reason ``abort``, with what
        was generated so far) still arrive on the stream."""
        with self._cond:
            pending = list(self._pending)
        for rid in pending:
            self._engine.abort(rid)

    def close(self) -> None:
        """Abort the unfinished requests and stop reading: nothing more arrives (no-op once all finished)."""
        with self._cond:
            pending, self._pending = list(self._pending), set()
            self._items.clear()
            self._cond.notify_all()  # a reader blocked in another thread sees the stream end
            listener = self._listener
        if listener is not None:  # so does a reader of its audio
            listener.closed(self)
        for rid in pending:
            self._engine.abort(rid)

    def listen(self, listener) -> None:
        """Have ``listener.mark(stream)`` called after each output and ``listener.closed(stream)`` at ``close``;
        the engine calls ``listener.wake(hurry=...)`` once after handing out a step's outputs (``hurry``: a
        request waits for the engine's next step on its way to first audio). None stops it."""
        with self._cond:
            self._listener = listener

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # an abandoned stream must not hold its blocks
        if getattr(self, "_pending", None):
            self.close()

    # ---------------------------------------------------------------- consumer side
    def __iter__(self) -> Iterator[RequestOutput]:
        return self

    def __next__(self) -> RequestOutput:
        with self._cond:
            while not self._items:
                if not self._pending:
                    raise StopIteration
                self._cond.wait()
            return self._check(self._items.popleft())

    def take(self) -> list[RequestOutput]:
        """Every output there now (maybe none), without waiting. A failed request's output raises ``RequestError``
        like iteration does: the outputs queued before it are returned first, and the next call raises."""
        with self._cond:
            batch = []
            while self._items:
                if self._items[0].error is not None and batch:
                    break
                batch.append(self._check(self._items.popleft()))
            return batch

    def has_outputs(self) -> bool:
        with self._cond:
            return bool(self._items)

    def exhausted(self) -> bool:
        """Every request finished (or the stream was closed) and every output was read."""
        with self._cond:
            return not self._items and not self._pending

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            with self._cond:
                if self._items:
                    return self._check(self._items.popleft())
                if not self._pending:
                    raise StopAsyncIteration
                if self._event is None:
                    self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
                self._event.clear()
            await self._event.wait()

    @staticmethod
    def _check(out: RequestOutput) -> RequestOutput:
        if out.error is not None:
            raise RequestError(f"request {out.request_id!r} failed: {out.error!r}") from out.error
        return out

    # ---------------------------------------------------------------- engine side
    def deliver(self, out: RequestOutput, now: float) -> None:
        """Hand the stream an output of one of its requests (the engine thread, at ``now``)."""
        times = self.times[out.request_id]
        if times.first_token is None and out.num_generated:
            times.first_token = now
        if out.finished:
            times.finished, times.finish_reason = now, out.finish_reason
        with self._cond:
            if out.request_id not in self._pending:
                return  # closed by the consumer: nobody reads it
            if out.finished:
                self._pending.discard(out.request_id)
            self._items.append(out)
            self._cond.notify_all()
            loop, event, listener = self._loop, self._event, self._listener
        if listener is not None:
            listener.mark(self)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)
