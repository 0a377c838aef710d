"""The front's side of the engine process: ``RemoteClient``, the engine seam over the three pipes of one front.

The front never touches the model: it prepares and validates every request from the ``SpeechKit`` the engine
process sends once it loaded (the same 4xx as in one process), sends the prompts to run and answers at once,
with no round trip before the response's headers. A client that leaves has its request cancelled over the pipe
(the engine process aborts its engine requests at once). If the engine process dies, every request and call in
flight fails with ``EngineGoneError``, and so does every new one; ``health`` says why. The engine process beats
every ``BEAT_S``: a front that hears no beat for ``beat_timeout_s`` (a hung or stopped engine process) is
unhealthy and refuses new requests, and its sends never wait for the pipe (``CommandWriter``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from ...engine import EngineStats, Prompt, SamplingParams
from ...params import RefineTextParams
from ..client import EngineClient, EngineGoneError, EngineInfo
from ..voices import SharedVoices, Voice, VoiceRegistry
from .host import EngineSettings, engine_main
from .messages import (
    AddFront,
    AudioBatch,
    Beat,
    Call,
    CallKind,
    Cancel,
    Collect,
    Collected,
    Failed,
    FrontEnds,
    PeerMetrics,
    PromptArrays,
    Ready,
    Refine,
    RegisterVoice,
    Reply,
    Start,
    Stats,
    Stop,
    VoiceAdded,
    open_pipes,
    recv_audio,
)
from .remote_audio import RemoteAudio
from .writer import CommandWriter, PipeClosedError

logger = logging.getLogger(__name__)


class RemoteClient(EngineClient):
    """One front's handle on the engine process: ``start_engine`` spawns it (this front is its first), or
    ``RemoteClient(ends, index)`` joins it from another process; then ``wait_ready``, the ``EngineClient``
    calls, and ``close``. Its request and call ids start with its ``index``."""

    def __init__(self, ends: FrontEnds, index: int = 0, process: mp.Process | None = None,
                 voices_dir: str | None = None, shared_voices: SharedVoices | None = None,
                 beat_timeout_s: float = 10.0):
        """``ends``: this front's pipe ends; ``process``: the engine process if this one started it;
        ``voices_dir``, ``shared_voices``: as ``VoiceRegistry``'s (voices other processes registered);
        ``beat_timeout_s``: how long the engine process may go without a beat before it counts as hung."""
        self.ends, self.index, self.process = ends, index, process
        self.beat_timeout_s = beat_timeout_s
        self._writer: CommandWriter | None = None  # from ``wait_ready`` on
        self._beat: tuple[float, str | None] = (time.monotonic(), None)  # the last beat: when, and its health
        self.peers: list[FrontEnds] = []
        """``start_engine``'s pipe ends of the other fronts, each for a ``RemoteClient(ends, index=i)`` (i from
        1) in a process of its own; close them here once that process started."""
        self.gone: str | None = None
        """Why the engine process is not running (None while it is)."""
        self._voices_dir, self._shared_voices = voices_dir, shared_voices
        self._reap_lock = threading.Lock()  # one waiter on the engine process at a time (``_join``)
        self._lock = threading.Lock()  # guards the two dicts below
        self._audio: dict[str, RemoteAudio] = {}
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # calls, by id
        self._ids = itertools.count()
        self._pid = os.getpid()
        self._closing = False
        self._own: Callable[[], list] | None = None
        self.on_lost: Callable[[str], None] | None = None
        """Called (from a reader thread) with why, if the engine process exits while this front uses it: a
        server stops then, so that its supervisor can restart it."""
        self._events = {Reply: self._on_reply, Failed: self._on_failed, Collect: self._on_collect,
                        VoiceAdded: self._on_voice, Beat: self._on_beat}

    @classmethod
    def start_engine(cls, load: dict, settings: EngineSettings | None = None, fronts: int = 1,
                     backlog: Callable[[], bool] | None = None, **front) -> RemoteClient:
        """Spawn the engine process (``load_chat(load)``, served to ``fronts`` fronts); this handle is the
        first front (``front``: the constructor's other keywords), ``peers`` the others' pipe ends. ``backlog``:
        a picklable callable saying whether the fronts' requests queue for running slots, for the engine's
        scheduler (``AsyncLLMEngine.set_backlog``). The process inherits this one's environment (a Ray
        replica's ``CUDA_VISIBLE_DEVICES`` included)."""
        settings = settings or EngineSettings()
        ctx = mp.get_context("spawn")  # not a fork of a process with threads (and torch)
        engine_ends, front_ends = open_pipes(fronts, ctx)
        process = ctx.Process(target=engine_main, name="chattts-velocity-engine", daemon=True,
                              args=(load, settings, engine_ends, backlog))
        process.start()
        for ends in engine_ends:
            ends.close()
        client = cls(front_ends[0], process=process, voices_dir=settings.voices_dir, **front)
        client.peers = front_ends[1:]
        return client

    def add_front(self, index: int) -> FrontEnds:
        """Pipes for a new front ``index`` (replacing one whose process died), the engine process told to serve
        it: the ends returned are for a ``RemoteClient(ends, index)`` in the new front's process. Only the
        front that started the engine process adds fronts."""
        engine_ends, front_ends = open_pipes(1, mp.get_context("spawn"))
        try:
            self._send(AddFront(index, engine_ends[0]))  # the descriptors go with it
        finally:
            engine_ends[0].close()
        return front_ends[0]

    # ---------------------------------------------------------------- lifetime
    def wait_ready(self, timeout: float = 1800.0) -> EngineInfo:
        """Block until the engine process loaded the model (and warmed up); ``RuntimeError`` if it died or
        took longer than ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not self.ends.events.poll(0.5):
            if self.process is not None and not self.process.is_alive():
                raise RuntimeError(f"the engine process exited with {self.process.exitcode} while loading the model "
                                   "(its log is above)")
            if time.monotonic() > deadline:
                self.close(0)
                raise RuntimeError(f"the engine process was not ready after {timeout:g} s")
        try:
            ready = self.ends.events.recv()
        except EOFError:
            raise RuntimeError("the engine process exited while loading the model (its log is above)") from None
        if not isinstance(ready, Ready):
            raise RuntimeError(f"the engine process said {type(ready).__name__} before Ready")
        self.info, self.kit = ready.info, ready.kit
        self._beat = time.monotonic(), None
        self._writer = CommandWriter(self.ends.cmd)
        self.voices = VoiceRegistry(self.kit.speaker_stats, self.kit.config.hidden_size, self._voices_dir,
                                    self._shared_voices)
        for name, conn, handlers, receive in (("events", self.ends.events, self._events, None),
                                              ("audio", self.ends.audio, {AudioBatch: self._on_audio}, recv_audio)):
            threading.Thread(target=self._read, args=(conn, handlers, receive),
                             name=f"chattts-velocity-engine-{name}", daemon=True).start()
        return self.info

    def close(self, timeout: float = 30.0) -> None:
        """Leave the engine process (its requests from here are cancelled); if this front started it, wait up
        to ``timeout`` s for it to exit once every front left."""
        self._closing = True
        self._send_quietly(Stop())
        if self.process is not None and self._join(timeout) is None:
            self.process.terminate()
            self._join(5)

    def _join(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the engine process to exit; its exit code, None if it runs on. Both
        pipe readers and ``close`` may wait at once: two concurrent waits on one child can leave the loser
        without its exit code, so they take turns."""
        with self._reap_lock:
            self.process.join(timeout)
            return self.process.exitcode

    def health(self) -> str | None:
        if self.gone is not None:
            return self.gone
        at, engine_health = self._beat
        silent = time.monotonic() - at
        if silent > self.beat_timeout_s:
            return f"the engine process has not answered for {silent:.0f} s (hung or stopped)"
        return engine_health

    # ---------------------------------------------------------------- requests and calls
    def start(self, prompts: list[Prompt], params: SamplingParams, in_flight: int) -> RemoteAudio:
        """Start the request in the engine process and return its audio at once (no answer is waited for)."""
        self._refuse_if_unhealthy()
        rid = self._next_id()
        audio = RemoteAudio(rid, self._cancel)
        with self._lock:
            self._audio[rid] = audio
        try:
            self._send(Start(rid, [PromptArrays.of(p) for p in prompts], params, in_flight))
        except EngineGoneError:
            with self._lock:
                self._audio.pop(rid, None)
            raise
        return audio

    async def refine(self, texts: list[str], params: RefineTextParams) -> list[str]:
        return await self._call(Refine(list(texts), params))

    async def register_voice(self, name: str, wav: np.ndarray, transcript: str) -> Voice:
        voice = await self._call(RegisterVoice(name, wav, transcript))
        self.voices.remember(voice)
        return voice

    async def stats(self) -> EngineStats:
        return await self._call(Stats())

    async def peer_metrics(self, timeout: float = 5.0) -> list:
        """The other fronts' ``share_metrics`` families, through the engine process; fronts that do not all
        answer within ``timeout`` s are left out (logged)."""
        try:
            return await asyncio.wait_for(self._call(PeerMetrics()), timeout)
        except asyncio.TimeoutError:  # not TimeoutError's alias before Python 3.11
            logger.warning("/metrics: a front did not report its metrics within %g s; rendered without it", timeout)
            return []

    def share_metrics(self, own: Callable[[], list]) -> None:
        self._own = own

    async def _call(self, call: CallKind):
        """Make a call and await its ``Reply``; cancelling the awaiting task cancels it there."""
        self._refuse_if_unhealthy()
        cid = self._next_id()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiting[cid] = loop, future
        try:
            self._send(Call(cid, call))
            reply = await future
        except asyncio.CancelledError:
            self._send_quietly(Cancel(cid))
            raise
        finally:
            with self._lock:
                self._waiting.pop(cid, None)
        return reply.result()

    def _next_id(self) -> str:
        # the process id too: a front that replaces a dead one (same index) never reuses its ids
        return f"f{self.index}.{self._pid}.{next(self._ids)}"

    def _cancel(self, rid: str) -> None:
        """A ``RemoteAudio`` was cancelled: tell the engine process, unless its audio had ended."""
        with self._lock:
            known = self._audio.pop(rid, None) is not None
        if known:
            self._send_quietly(Cancel(rid))

    def _send(self, msg) -> None:
        if self.gone is not None:
            raise EngineGoneError(self.gone)
        if self._writer is None:
            raise EngineGoneError("the engine process is not ready")
        try:
            self._writer.send(msg)
        except PipeClosedError as e:
            raise EngineGoneError(f"the engine process is not running ({e})") from None

    def _refuse_if_unhealthy(self) -> None:
        """New work is refused (503) while the engine process is gone or unresponsive: it would only queue."""
        why = self.health()
        if why is not None:
            raise EngineGoneError(why)

    def _send_quietly(self, msg) -> None:
        try:
            self._send(msg)
        except EngineGoneError:
            pass

    # ---------------------------------------------------------------- the reader threads
    def _read(self, conn, handlers: dict, receive=None) -> None:
        """Hand every message of ``conn`` to its handler until the engine process closes it; ``receive(conn)``
        reads one (None: ``conn.recv``; the audio pipe's: ``recv_audio``)."""
        while True:
            try:
                msg = conn.recv() if receive is None else receive(conn)
            except (EOFError, OSError):
                break
            handler = handlers.get(type(msg))
            if handler is None:
                logger.error("the engine process sent an unknown message %s: ignored", type(msg).__name__)
                continue
            try:
                handler(msg)
            except Exception:  # noqa: BLE001 - one message's failure; a reader that stopped would strand the front
                logger.exception("handling %s from the engine process failed", type(msg).__name__)
        self._lost()

    def _on_reply(self, msg: Reply) -> None:
        with self._lock:
            entry = self._waiting.pop(msg.cid, None)
        if entry is not None:
            _settle(*entry, msg)

    def _on_failed(self, msg: Failed) -> None:
        with self._lock:
            audio = self._audio.pop(msg.rid, None)
        if audio is not None:
            audio.deliver(None, msg.message)

    def _on_collect(self, msg: Collect) -> None:
        try:
            families = self._own() if self._own is not None else []
        except Exception:  # noqa: BLE001 - the asking front renders without ours rather than waiting for them
            logger.exception("collecting this front's metrics for another front failed")
            families = None
        self._send_quietly(Collected(msg.key, families))

    def _on_voice(self, msg: VoiceAdded) -> None:
        self.voices.remember(msg.voice)

    def _on_beat(self, msg: Beat) -> None:
        self._beat = time.monotonic(), msg.health

    def _on_audio(self, msg: AudioBatch) -> None:
        with self._lock:
            targets = [(self._audio.get(item.rid), item) for item in msg.items]
            for item in msg.items:
                if item.chunk is None:
                    self._audio.pop(item.rid, None)
        for audio, item in targets:
            if audio is not None:
                audio.deliver(item.chunk, item.failure)

    def _lost(self) -> None:
        """A pipe from the engine process closed: it exited. Fail everything in flight (once)."""
        code = None
        if self.process is not None:
            code = self._join(2)  # reaped, so its exit code is known
        with self._lock:
            if self.gone is not None:
                return
            self.gone = "the engine process exited" + (f" with {code}" if code is not None else "")
            audios, self._audio = list(self._audio.values()), {}
            waiting, self._waiting = list(self._waiting.values()), {}
        if not self._closing:
            logger.error("%s: failing every request in flight", self.gone)
        for audio in audios:
            audio.deliver(None, self.gone)
        for loop, future in waiting:
            _settle(loop, future, EngineGoneError(self.gone))
        if not self._closing and self.on_lost is not None:
            self.on_lost(self.gone)


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value) -> None:
    """Resolve ``future`` on its loop from this thread (an exception ``value`` is raised there)."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed
        pass
