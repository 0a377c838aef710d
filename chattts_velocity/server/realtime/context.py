"""``SpeechContext``: one realtime context's speech. Text arrives in appends of any size; each sentence (the
HTTP route's split, applied as the text arrives: ``SentenceBuffer``) becomes its own engine request the moment
its end is seen, up to ``in_flight`` of them generating at once; their audio is read in order on the event loop
and joined exactly as the HTTP route joins a request's sentences (``Joiner``), so a context's audio equals that
route's for the same whole text, however it was cut into appends."""

from __future__ import annotations

import asyncio
import copy
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from ...audio.joins import Joiner
from ...constants import SAMPLE_RATE
from ...engine import Prompt, SamplingParams
from ...params import InferCodeParams
from ...pipeline import take_ready
from ...serving.client import EngineClient, RequestAudio
from ...text.split import SentenceBuffer


@dataclass(frozen=True)
class AudioOut:
    """The context's next samples: mono float32 at 24 kHz, never empty."""

    samples: np.ndarray


@dataclass(frozen=True)
class SegmentOut:
    """A spoken sentence's place in the context's audio, in seconds from its start; sent once the sentence's
    audio is complete, before any audio of the next. Its last few samples (the join's fade) may follow it."""

    text: str
    """The sentence as appended (a newline that ended it dropped)."""
    start_s: float
    end_s: float


@dataclass(frozen=True)
class DoneOut:
    """The context's audio is all out (the last event)."""

    input_characters: int
    audio_seconds: float


@dataclass(frozen=True)
class FailedOut:
    """The context failed and ends (the last event, unless ``code`` is ``invalid_input`` for a context with
    nothing readable: a ``DoneOut`` with no audio follows)."""

    message: str
    code: str = "generation_failed"
    """``generation_failed`` (the engine or the audio failed) or ``invalid_input`` (a sentence the engine
    refuses, e.g. too long for its KV cache; or nothing readable in the whole context)."""


ContextEvent = AudioOut | SegmentOut | DoneOut | FailedOut


@dataclass
class _Part:
    """One engine request of the context: one model text's prompt."""

    prompts: list[Prompt]
    params: SamplingParams
    sentence: str | None
    """The text of the segment this part ends (the last part of a sentence the long-text cut split), else None."""
    audio: RequestAudio | None = None


class SpeechContext:
    """One context: ``append`` / ``flush`` / ``end`` / ``cancel`` (called on the event loop, never waiting),
    and ``events`` (iterated once, on the same loop) yielding its ``ContextEvent``s. The engine is put to work
    only while ``events`` is being iterated (its reader holds the admission slot)."""

    def __init__(self, client: EngineClient, context_id: str, code_params: InferCodeParams, in_flight: int,
                 max_buffered_chars: int):
        """``ValueError`` for settings the engine refuses (checked now, before any text)."""
        if in_flight < 1 or max_buffered_chars < 1:
            raise ValueError(f"in_flight and max_buffered_chars must be at least 1, got {in_flight}, "
                             f"{max_buffered_chars}")
        self.client, self.context_id, self.code_params = client, context_id, code_params
        self.in_flight, self.max_buffered_chars = in_flight, max_buffered_chars
        _, params = client.kit.prompts([], code_params)  # the speaker and the voice sample, decoded
        params.validate(client.kit.config.num_vq, client.kit.config.num_audio_tokens)
        self._buffer = SentenceBuffer()
        self._waiting: deque[_Part] = deque()  # not started yet
        self._live: deque[_Part] = deque()  # started, in order; the first is being read
        self._head: _Part | None = None  # the part whose audio wakes the reader (read from the engine's thread)
        self._joiner = Joiner()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._characters = self._parts = 0
        self._unreadable: str | None = None  # why the first dropped sentence was dropped
        self._ended = self._cancelled = False
        self._failure: FailedOut | None = None
        self._sent = 0  # samples handed out
        self._mark = 0  # where the sentence being read starts, in samples
        self._tail_open = False  # the joiner holds a finished sentence's tail: whether it was the last is open

    # ---------------------------------------------------------------- input (on the event loop)
    def append(self, text: str) -> None:
        """Buffer ``text``; every sentence it completes starts (once ``events`` runs). ``ValueError`` (and
        nothing appended) if ``text``, or the unfinished sentence it leaves, is longer than
        ``max_buffered_chars``, or if the context has ended."""
        if self._ended:
            raise ValueError(f"context {self.context_id!r} has ended: no more text")
        cap = self.max_buffered_chars
        if len(text) > cap:
            raise ValueError(f"{len(text)} characters appended at once, at most {cap} may be")
        buffer = copy.copy(self._buffer)
        pieces = buffer.append(text)
        if buffer.pending > cap:
            raise ValueError(f"{buffer.pending} characters would wait for their sentence's end, at most {cap} may: "
                             "end the sentence or flush first")
        if self._closed:
            return
        self._buffer = buffer
        self._characters += len(text)
        self._queue(pieces)

    def flush(self) -> None:
        """Speak what is buffered now, as a sentence of its own; the context stays open."""
        if not self._closed:
            self._queue(self._buffer.flush())

    def end(self) -> None:
        """Flush; the context ends once its audio is out."""
        self._ended = True
        self.flush()
        self._wake.set()

    def speak(self, texts: list[str], prompts: list[Prompt], params: SamplingParams) -> None:
        """Queue sentences already prepared and validated (``kit.prepare_texts``, a refine pass if any, then
        ``kit.prompts``: what the HTTP route has for a whole request), each its own sentence and segment."""
        for text, prompt in zip(texts, prompts, strict=True):
            self._waiting.append(_Part([prompt], params, text))
            self._parts += 1
        self._wake.set()

    def cancel(self) -> None:
        """End now: every started request is cancelled (its engine work ends) and ``events`` yields nothing
        more. Idempotent."""
        self._cancelled = True
        self._stop()
        self._wake.set()

    @property
    def _closed(self) -> bool:
        return self._cancelled or self._failure is not None

    def _queue(self, pieces: list[str]) -> None:
        for piece in pieces:
            try:
                texts = self.client.kit.prepare_texts(piece)
            except ValueError as e:  # nothing readable: dropped, as the HTTP route drops such a sentence
                self._unreadable = self._unreadable or str(e)
                continue
            for i, text in enumerate(texts):
                try:
                    prompts, params = self.client.kit.prompts([text], self.code_params)
                except ValueError as e:
                    self._failure = FailedOut(str(e), "invalid_input")
                    self._wake.set()
                    return
                self._waiting.append(_Part(prompts, params, piece if i == len(texts) - 1 else None))
                self._parts += 1
        self._wake.set()

    # ---------------------------------------------------------------- output
    async def events(self) -> AsyncIterator[ContextEvent]:
        """The context's events until it is done, failed or cancelled. Leaving early cancels it."""
        self._loop = asyncio.get_running_loop()
        try:
            while not self._cancelled:
                self._wake.clear()  # before looking: news from here on sets it again
                out, over = self._step()
                for event in out:
                    yield event
                    if self._cancelled:
                        return
                if over:
                    return
                if not out:
                    await self._wake.wait()
        finally:
            self._stop()

    def _step(self) -> tuple[list[ContextEvent], bool]:
        """Every event there is now, and whether the context is over."""
        out: list[ContextEvent] = []
        if self._failure is not None:
            self._stop()
            return [self._failure], True
        while True:
            self._start()
            self._join(out)
            if not self._live:
                break
            part = self._head = self._live[0]
            chunk, end, failure = take_ready(part.audio)
            if chunk is not None:
                self._emit(out, self._joiner.push(chunk))
            if failure is not None:
                self._stop()
                return [*out, FailedOut(f"generation failed: {failure}")], True
            if not end:
                return out, False
            self._live.popleft().audio.close()
            self._finished(part, out)
        if not self._ended:
            return out, False
        if not self._parts:
            out.append(FailedOut(self._unreadable or "nothing to speak: the context's text was blank", "invalid_input"))
        out.append(DoneOut(self._characters, self._sent / SAMPLE_RATE))
        return out, True

    def _start(self) -> None:
        """Start waiting parts while fewer than ``in_flight`` are live."""
        while self._waiting and len(self._live) < self.in_flight:
            part = self._waiting.popleft()
            part.audio = self.client.start(part.prompts, part.params, 1)
            part.audio.on_ready(partial(self._notify, part))
            self._live.append(part)
            part.audio.start()

    def _finished(self, part: _Part, out: list[ContextEvent]) -> None:
        """``part``'s audio is all read: its tail is joined to the next part's (once there is one), and its
        sentence's segment reported."""
        end = self._sent + self._joiner.held
        self._tail_open = True
        self._start()
        self._join(out)
        if part.sentence is not None:
            out.append(SegmentOut(part.sentence, self._mark / SAMPLE_RATE, end / SAMPLE_RATE))
            self._mark = end

    def _join(self, out: list[ContextEvent]) -> None:
        """A held tail out, once it is known whether another part follows it: faded out if one does, as it is
        if the context ended."""
        if not self._tail_open:
            return
        if self._live:
            self._emit(out, self._joiner.next_sentence())
        elif self._ended:
            self._emit(out, self._joiner.finish())
        else:
            return
        self._tail_open = False

    def _emit(self, out: list[ContextEvent], samples: np.ndarray) -> None:
        if samples.size:
            self._sent += samples.size
            out.append(AudioOut(samples))

    def _notify(self, part: _Part) -> None:
        """From the engine's thread: news of ``part``'s audio; only the part being read wakes the reader (a
        later one is read, all it has, when its turn comes)."""
        if part is self._head:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop closed: nobody reads any more
                pass

    def _stop(self) -> None:
        live, self._head = list(self._live), None
        self._live.clear()
        self._waiting.clear()
        for part in live:
            part.audio.cancel()
