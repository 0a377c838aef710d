"""The engine in a process of its own (``serve --engine-process``): this process answers HTTP (FastAPI, uvicorn,
the audio encoders); a child process loads the model and runs the engine thread and the audio pump; they talk
over three pipes. Requests, cancels and calls (voice registration, stats) go down one; acknowledgements,
replies and refusals come back on another, and the requests' audio chunks on a third (every chunk a round made
ready in one message), so that an acknowledgement never queues behind a round's audio.

Why: a Python process runs one thread at a time (the GIL). In one process the event loop's HTTP and encoding
work and the engine thread's steps and audio rounds take turns: at 256 streams on an H100 the server process
used 8.2 s of CPU over a 6.6 s level with the engine thread busy throughout, and every device wait of the engine
thread handed the GIL to the loop, which the engine thread then waited to get back
(`python benchmarks/serve_timeline.py --http`). Apart, each has a GIL of its own.

The front never touches the model. It prepares and validates a request itself, from the ``SpeechKit`` the engine
process sent once it loaded (tokenizer, model config, speaker statistics, KV capacity: ``prepare.prepare_prompts``,
the same 4xx as the one-process server), sends the prompts to run and answers at once: before, every request
went to the engine process to be prepared and the headers waited for its acknowledgement, which took 149-216 ms
p99 when 64 requests came together, the engine process's command thread waiting for the GIL behind its engine
thread. A request with a refine pass needs the engine for it and still goes that way (``_Host._prepare``).
``RemoteAudio`` reads like ``JoinedAudio``. A client that leaves has its request
cancelled over the pipe (the engine process aborts its engine requests at once). If the engine process dies,
every request in flight fails, ``/health`` answers 503 and new requests get 503. The engine process ignores
SIGINT and SIGTERM: the front drains and then stops it (or it exits when the front's pipe closes).

With ``serve --fronts N`` the engine process serves N fronts, each over three pipes of its own (``_Front``):
their request ids carry the front's index, each front's audio goes down its own pipe, and the engine process
relays what the fronts share: a registered voice (``voice``), and another front's request metrics for a
``/metrics`` (``gather``, answered by each front's ``collect``). It exits once every front is gone."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import signal
import threading
import time
from collections import deque
from dataclasses import asdict

import numpy as np
import torch

from ..audio.pump import PENDING, take_ready
from ..engine import Prompt
from .config import ServerConfig
from .prepare import SpeechKit, prepare_speech
from .schema import SpeechRequest
from .voices import UnknownVoiceError, VoiceRegistry

logger = logging.getLogger(__name__)


class EngineGoneError(RuntimeError):
    """The engine process is not running (it exited or was killed): the server cannot generate."""


# ============================================================================ the engine process
def _engine_main(load: dict, config: ServerConfig, warmup: bool | None, log_level: str, threads: int | None,
                 fronts: list[tuple]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front owns the lifetime (a Ctrl-C reaches the group)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s [engine process] %(name)s: %(message)s")
    from ..chat import Chat
    from .run import warm_up

    if threads is not None:
        torch.set_num_threads(threads)
    chat = Chat()
    chat.load(**load)
    if warmup if warmup is not None else chat.device.type == "cuda":
        warm_up(chat)
    chat._velocity.pump.round_interval_s = config.audio_round_ms / 1000
    host = _Host(chat, config, fronts)
    host.announce()
    try:
        host.serve()
    finally:
        chat.unload()


class _Front:
    """One HTTP front's pipe ends, as the engine process holds them: commands come on ``cmd``; acks, replies
    and refusals go on ``events``, the requests' audio on ``audio`` (the shipper's alone)."""

    def __init__(self, index: int, cmd, events, audio):
        self.index, self.cmd, self.events, self.audio = index, cmd, events, audio
        self.send_lock = threading.Lock()
        self.open = True
        """False once the front said stop or its pipe closed."""


class _Host:
    """The engine process's side: prepares requests, ships their audio, answers calls, for one or more fronts
    (``serve --fronts``). Request ids are unique across fronts (each front its own prefix)."""

    def __init__(self, chat, config: ServerConfig, fronts: list[tuple]):
        self.chat, self.config = chat, config
        self.voices = VoiceRegistry(chat, config.voices_dir)
        self.fronts = [_Front(i, *ends) for i, ends in enumerate(fronts)]
        self._cond = threading.Condition()  # guards the four below
        self._audio: dict[str, object] = {}  # request id -> its JoinedAudio
        self._owner: dict[str, _Front] = {}  # request id -> the front it came from
        self._due: dict[str, None] = {}  # requests with news for the shipper, in order
        self._preparing: dict[str, bool] = {}  # request id -> cancelled while being prepared
        self._gathers: dict[tuple, tuple[_Front, set[int], dict]] = {}  # see ``_gather``
        threading.Thread(target=self._ship, name="chattts-velocity-ship", daemon=True).start()

    def announce(self) -> None:
        """Tell every front the engine is ready, with what it prepares requests from (``SpeechKit``)."""
        for front in self.fronts:
            self.send(front, ("ready", {"device": str(self.chat.device), "kit": SpeechKit.of(self.chat)}))

    def send(self, front: _Front, msg) -> None:
        """Send ``msg`` on ``front``'s events pipe; a front that went away misses it."""
        try:
            with front.send_lock:
                front.events.send(msg)
        except (OSError, EOFError, ValueError):
            pass

    def serve(self) -> None:
        """Handle the fronts' messages until every front said stop or went away; a front that leaves has its
        requests cancelled."""
        listening = {front.cmd: front for front in self.fronts}
        while listening:
            for conn in mp_connection.wait(list(listening)):
                front = listening[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = ("stop",)
                if msg[0] == "stop":
                    del listening[conn]
                    self._leave(front)
                else:
                    self._handle(front, msg)

    def _handle(self, front: _Front, msg) -> None:
        kind = msg[0]
        if kind == "submit":
            _, rid, fields = msg
            try:
                body = SpeechRequest.model_validate(fields)  # validated by the front already
            except Exception as e:  # noqa: BLE001 - reported to the front as a 500, the loop goes on
                self.send(front, ("ack", rid, ("internal", f"{type(e).__name__}: {e}")))
                return
            with self._cond:
                self._preparing[rid] = False
                self._owner[rid] = front
            if body.refines:  # the refine pass waits for the engine: not on this thread
                threading.Thread(target=self._prepare, args=(rid, body), daemon=True).start()
            else:
                self._prepare(rid, body)
        elif kind == "run":
            self._run(front, *msg[1:])
        elif kind == "cancel":
            self._cancel(msg[1])
        elif kind == "call":
            threading.Thread(target=self._call, args=(front, *msg[1:]), daemon=True).start()
        elif kind == "gather":
            self._gather(front, msg[1])
        elif kind == "families":
            self._gathered(msg[1], front.index, msg[2])

    def _leave(self, front: _Front) -> None:
        """``front`` is gone: cancel its requests, and stop waiting for its metrics."""
        front.open = False
        with self._cond:
            rids = [rid for rid, owner in self._owner.items() if owner is front]
        for rid in rids:
            self._cancel(rid)
        for key in list(self._gathers):
            self._gathered(key, front.index, None)

    def _gather(self, asker: _Front, cid: int) -> None:
        """Every other open front's request metrics (``Metrics.own``), for ``asker``'s ``/metrics``: each is
        asked (``collect``), and the reply goes out once all answered or left."""
        others = {f.index for f in self.fronts if f.open and f is not asker}
        key = (asker.index, cid)
        self._gathers[key] = (asker, others, {})
        for index in list(others):
            self.send(self.fronts[index], ("collect", key))
        self._gathered(key, None, None)  # none to ask: the reply goes at once

    def _gathered(self, key: tuple, index: int | None, families) -> None:
        entry = self._gathers.get(key)
        if entry is None:
            return
        asker, waiting, got = entry
        if index is not None and index in waiting:
            waiting.discard(index)
            if families is not None:
                got[index] = families
        if not waiting:
            del self._gathers[key]
            self.send(asker, ("reply", key[1], None, list(got.values())))

    def _run(self, front: _Front, rid: str, prompts, params) -> None:
        """A request the front prepared (``prepare.prepare_prompts``): its audio starts now. It was validated
        there; should the engine refuse it all the same, its audio ends with the error (its headers are out)."""
        try:
            audio = self.chat._velocity.joined(_prompts(prompts), params, True, self.config.in_flight_sentences)
        except Exception as e:  # noqa: BLE001 - the request's failure, not the engine process's
            logger.warning("request %s refused: %s", rid, e)
            self.send(front, ("failed", rid, f"{type(e).__name__}: {e}"))
            return
        audio.on_ready(lambda: self._mark(rid))
        with self._cond:
            self._audio[rid] = audio
            self._owner[rid] = front
        self._mark(rid)  # its first ``next`` submits its engine requests

    def _prepare(self, rid: str, body: SpeechRequest) -> None:
        """A request with a refine pass, prepared here (``prepare_speech``); the front waits for the ack."""
        try:
            audio = prepare_speech(self.chat, self.voices, self.config, body)
        except Exception as e:  # noqa: BLE001 - reported to the front: a 404, a 400, else a 500
            if isinstance(e, UnknownVoiceError):
                error = ("voice", str(e))
            elif isinstance(e, ValueError):
                error = ("input", str(e))
            else:
                logger.exception("preparing request %s failed", rid)
                error = ("internal", f"{type(e).__name__}: {e}")
            with self._cond:
                del self._preparing[rid]
                front = self._owner.pop(rid)
            self.send(front, ("ack", rid, error))
            return
        audio.on_ready(lambda: self._mark(rid))
        with self._cond:
            cancelled = self._preparing.pop(rid)
            front = self._owner[rid]
            if cancelled:
                del self._owner[rid]
            else:
                self._audio[rid] = audio
        if cancelled:
            audio.cancel()
            return
        self.send(front, ("ack", rid, None))
        self._mark(rid)  # its first ``next`` submits its engine requests

    def _mark(self, rid: str) -> None:
        with self._cond:
            self._due[rid] = None
            self._cond.notify()

    def _cancel(self, rid: str) -> None:
        with self._cond:
            audio = self._audio.pop(rid, None)
            if audio is not None:
                self._owner.pop(rid, None)
            if audio is None:  # being prepared (``_prepare`` drops it then), or already over
                if rid in self._preparing:
                    self._preparing[rid] = True
                return
        audio.cancel()  # thread-safe, even while the shipper is inside its ``next``

    def _ship(self) -> None:
        """Send every chunk that is ready, all of a front's requests' in one message per pass."""
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
                due, self._due = list(self._due), {}
                audios = [(rid, self._audio.get(rid), self._owner.get(rid)) for rid in due]
            items: dict[_Front, list] = {}
            for rid, audio, front in audios:
                if audio is None:
                    continue
                chunk, end, failure = take_ready(audio)
                if failure is not None:
                    logger.warning("request %s failed: %s", rid, failure)
                out = items.setdefault(front, [])
                if chunk is not None:
                    out.append((rid, chunk, None))
                if end:
                    out.append((rid, None, "" if failure is None else str(failure)))
                    with self._cond:
                        self._audio.pop(rid, None)
                        self._owner.pop(rid, None)
                    audio.cancel()
            for front, out in items.items():
                if out and front.open:
                    try:
                        front.audio.send(out)
                    except (OSError, EOFError):  # the front is gone: ``serve`` cancels its requests
                        pass

    def _call(self, front: _Front, cid: int, name: str, args: tuple) -> None:
        try:
            if name == "register":
                value = asdict(self.voices.register(*args))
                for other in self.fronts:  # every front resolves it from now on, with or without a voices folder
                    if other is not front and other.open:
                        self.send(other, ("voice", value))
            elif name == "stats":
                value = self.chat.engine.stats().engine
            else:
                raise ValueError(f"unknown call {name!r}")
            reply = ("reply", cid, None, value)
        except Exception as e:  # noqa: BLE001 - raised again in the front
            reply = ("reply", cid, type(e).__name__, str(e))
        self.send(front, reply)


# ============================================================================ the front
class RemoteAudio:
    """One request's audio coming from the engine process, read like ``JoinedAudio``: ``next`` returns the next
    chunk (float32), ``PENDING`` when none is there and ``on_ready`` gave a callback (else it waits), raises
    ``StopIteration`` at the end and ``RuntimeError`` if generation failed. ``cancel`` from any thread."""

    def __init__(self, owner: EngineProcess, rid: str):
        self._owner, self.rid = owner, rid
        self._cond = threading.Condition()
        self._items: deque[np.ndarray] = deque()
        self._notify = None
        self._over = False
        self._failure: str | None = None

    def __iter__(self) -> RemoteAudio:
        return self

    def __next__(self):
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

    def on_ready(self, notify) -> None:
        self._notify = notify

    def cancel(self) -> None:
        with self._cond:
            if self._over:
                return
            self._over = True
            self._cond.notify_all()
        self._owner._cancel(self.rid)

    close = cancel

    def _put(self, chunk: np.ndarray | None, failure: str | None) -> None:
        """A chunk, or (``chunk`` None) the end: ``failure`` says why it failed ("" if it did not)."""
        with self._cond:
            if self._over:
                return
            if chunk is None:
                self._over, self._failure = True, failure or None
            else:
                self._items.append(chunk)
            self._cond.notify_all()
            notify = self._notify
        if notify is not None:
            notify()


class _Stats:
    """What ``Metrics`` reads from an engine: the engine process's latest stats (``EngineProcess.refresh``)."""

    def __init__(self, engine):
        self.engine = engine


class EngineProcess:
    """The front's handle on the engine process: start it (``wait_ready``), prepare requests (``prepare``),
    make calls (``call``), read its stats (``stats``, as ``AsyncLLMEngine.stats`` for ``Metrics``), stop it
    (``close``)."""

    def __init__(self, cmd, events, audio, process=None, index: int = 0):
        """A handle over the pipe ends (``cmd`` to send on, ``events`` and ``audio`` to read) of an engine
        served by ``_Host`` (``start`` spawns one; a benchmark may host it itself), and its process if it is a
        child of this one. ``index``: which of the engine's fronts this is (its request ids start with it)."""
        self._cmd, self._events, self._audio_in, self.process = cmd, events, audio, process
        self.index = index
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the dicts below
        self._audio: dict[str, RemoteAudio] = {}
        self._waiting: dict[object, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # acks and replies
        self._ids = itertools.count()
        self._stats = None
        self.gone: str | None = None
        """Why the engine process is not running (None while it is)."""
        self._closing = False
        self.info: dict = {}
        self.fronts: list[tuple] = []
        """``start``'s pipe ends of the other fronts, each for an ``EngineProcess(*ends, index=i)`` (i from 1)
        in a process of its own."""
        self.collect = None
        """What this front answers when another front's ``/metrics`` gathers every front's (set by the app:
        ``Metrics.own``); None: nothing."""
        self.on_voice = None
        """Called with a voice record another front registered (set by the app)."""

    @classmethod
    def start(cls, load: dict, config: ServerConfig, warmup: bool | None = None, log_level: str = "info",
              threads: int | None = None, fronts: int = 1) -> EngineProcess:
        """Spawn the engine process: it runs ``Chat().load(**load)`` (and ``warm_up``, by default on CUDA).
        With ``fronts`` > 1 it serves that many fronts: this handle is the first, ``.fronts`` the others'
        pipe ends."""
        ctx = mp.get_context("spawn")  # not a fork of a process with threads (and torch)
        mine, theirs = [], []
        for _ in range(fronts):
            cmd_in, cmd = ctx.Pipe(duplex=False)
            events, events_out = ctx.Pipe(duplex=False)
            audio, audio_out = ctx.Pipe(duplex=False)
            mine.append((cmd, events, audio))
            theirs.append((cmd_in, events_out, audio_out))
        process = ctx.Process(target=_engine_main, name="chattts-velocity-engine", daemon=True,
                              args=(load, config, warmup, log_level, threads, theirs))
        process.start()
        for ends in theirs:
            for end in ends:
                end.close()
        handle = cls(*mine[0], process=process)
        handle.fronts = mine[1:]
        return handle

    # ---------------------------------------------------------------- lifetime
    def wait_ready(self, timeout: float = 1800.0) -> dict:
        """Block until the engine process loaded the model (and warmed up); raise ``RuntimeError`` if it died or
        took longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self._events.poll(0.5):
            if self.process is not None and not self.process.is_alive():
                raise RuntimeError(f"the engine process exited with {self.process.exitcode} while loading the model "
                                   "(its log is above)")
            if time.monotonic() > deadline:
                self.close(0)
                raise RuntimeError(f"the engine process was not ready after {timeout:g} s")
        try:
            kind, self.info = self._events.recv()
        except EOFError:
            raise RuntimeError("the engine process exited while loading the model (its log is above)") from None
        assert kind == "ready", kind
        for name, conn, handle in (("events", self._events, self._on_event), ("audio", self._audio_in, self._on_audio)):
            threading.Thread(target=self._read, args=(conn, handle), name=f"chattts-velocity-engine-{name}",
                             daemon=True).start()
        return self.info

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine process (requests still in it are cancelled) and wait up to ``timeout`` s."""
        self._closing = True
        try:
            self._send(("stop",))
        except EngineGoneError:
            pass
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)

    # ---------------------------------------------------------------- requests and calls
    async def prepare(self, body: SpeechRequest) -> RemoteAudio:
        """Submit a request to be prepared in the engine process (one with a refine pass, which needs the
        engine); its audio once the engine process accepted it. Raises what preparing it raised
        there: ``UnknownVoiceError``, ``ValueError`` (bad input), ``EngineGoneError``, ``RuntimeError``."""
        rid, audio = self._open()
        try:
            error = await self._request(rid, ("submit", rid, body.model_dump()))
        except BaseException:
            audio.cancel()  # a cancelled handler: the engine process drops it once prepared
            raise
        if error is not None:
            with self._lock:
                self._audio.pop(rid, None)
            kind, message = error
            raise (UnknownVoiceError if kind == "voice" else ValueError if kind == "input" else RuntimeError)(message)
        return audio

    def _open(self) -> tuple[str, RemoteAudio]:
        """A new request id and its audio, which the reader threads now feed."""
        rid = f"f{self.index}.r{next(self._ids)}"
        audio = RemoteAudio(self, rid)
        with self._lock:
            self._audio[rid] = audio
        return rid, audio

    @property
    def kit(self) -> SpeechKit:
        """What the front prepares requests with (``prepare.prepare_prompts``), from the engine process."""
        return self.info["kit"]

    def run(self, prompts, params) -> RemoteAudio:
        """Start a request prepared here (``prepare.prepare_prompts``) in the engine process; its audio, at
        once (no acknowledgement is waited for). Raises ``EngineGoneError``."""
        rid, audio = self._open()
        try:
            self._send(("run", rid, _arrays(prompts), params))
        except EngineGoneError:
            with self._lock:
                self._audio.pop(rid, None)
            raise
        return audio

    async def call(self, name: str, *args):
        """Run a call in the engine process (``register``, ``stats``); its error is raised
        again here (``ValueError`` as such, any other as ``RuntimeError``)."""
        cid = next(self._ids)
        error, value = await self._request(cid, ("call", cid, name, args))
        if error is not None:
            raise (ValueError if error == "ValueError" else RuntimeError)(value)
        return value

    async def gather(self, timeout: float = 5.0) -> list:
        """The other fronts' ``collect()`` (each a list of metric families), through the engine process; a
        front that does not answer within ``timeout`` s is left out (logged)."""
        cid = next(self._ids)
        try:
            _, value = await asyncio.wait_for(self._request(cid, ("gather", cid)), timeout)
        except asyncio.TimeoutError:  # not TimeoutError's alias before Python 3.11
            logger.warning("/metrics: a front did not report its metrics within %g s; rendered without it", timeout)
            return []
        return value

    async def refresh(self) -> None:
        """Fetch the engine's stats for the next ``stats()``."""
        self._stats = await self.call("stats")

    def stats(self) -> _Stats:
        if self._stats is None:
            raise RuntimeError("no stats yet: await refresh() first")
        return _Stats(self._stats)

    async def _request(self, key, msg):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiting[key] = loop, future
        try:
            self._send(msg)
            return await future
        finally:
            with self._lock:
                self._waiting.pop(key, None)

    def _cancel(self, rid: str) -> None:
        with self._lock:
            known = self._audio.pop(rid, None) is not None
        if known and self.gone is None:
            try:
                self._send(("cancel", rid))
            except EngineGoneError:
                pass

    def _send(self, msg) -> None:
        if self.gone is not None:
            raise EngineGoneError(self.gone)
        try:
            with self._send_lock:
                self._cmd.send(msg)
        except (OSError, ValueError) as e:  # a broken pipe, or closed
            raise EngineGoneError(f"the engine process is not running ({e})") from None

    # ---------------------------------------------------------------- the reader threads
    def _read(self, conn, handle) -> None:
        """Hand every message of ``conn`` to ``handle`` until the engine process closes it."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            handle(msg)
        self._lost()

    def _on_event(self, msg) -> None:
        """An acknowledgement, a reply, or a request the engine refused (``run``)."""
        if msg[0] == "ack":
            self._resolve(msg[1], msg[2])
        elif msg[0] == "reply":
            self._resolve(msg[1], (msg[2], msg[3]))
        elif msg[0] == "failed":
            self._on_audio([(msg[1], None, msg[2])])
        elif msg[0] == "collect":  # another front's /metrics
            families = self.collect() if self.collect is not None else []
            try:
                self._send(("families", msg[1], families))
            except EngineGoneError:
                pass
        elif msg[0] == "voice" and self.on_voice is not None:
            self.on_voice(msg[1])

    def _on_audio(self, items) -> None:
        """A round's chunks: (request id, chunk or None at its end, why it failed) each."""
        with self._lock:
            targets = [(self._audio.get(rid), chunk, failure) for rid, chunk, failure in items]
            for rid, chunk, _ in items:
                if chunk is None:
                    self._audio.pop(rid, None)
        for audio, chunk, failure in targets:
            if audio is not None:
                audio._put(chunk, failure)

    def _lost(self) -> None:
        """A pipe from the engine process closed: it exited. Fail everything in flight (once)."""
        code = None
        if self.process is not None:
            self.process.join(2)  # reaped, so its exit code is known
            code = self.process.exitcode
        with self._lock:
            if self.gone is not None:
                return
            self.gone = "the engine process exited" + (f" with {code}" if code is not None else "")
            audios, self._audio = list(self._audio.values()), {}
            waiting, self._waiting = list(self._waiting.values()), {}
        if not self._closing:
            logger.error("%s: failing every request in flight", self.gone)
        for audio in audios:
            audio._put(None, self.gone)
        for loop, future in waiting:
            _settle(loop, future, EngineGoneError(self.gone))

    def _resolve(self, key, value) -> None:
        with self._lock:
            entry = self._waiting.pop(key, None)
        if entry is not None:
            _settle(*entry, value)


def _arrays(prompts: list[Prompt]) -> list[tuple]:
    """Prompts as numpy arrays for the pipe. A torch tensor would go as shared memory whose file descriptor the
    receiver fetches from the sender's resource-sharer thread: a round trip per tensor, each needing the
    sender's GIL."""
    return [(p.ids.numpy(), p.text_mask.numpy(), None if p.speaker is None else p.speaker.numpy()) for p in prompts]


def _prompts(arrays: list[tuple]) -> list[Prompt]:
    """``_arrays`` back to prompts."""
    return [Prompt(torch.from_numpy(ids), torch.from_numpy(mask), None if spk is None else torch.from_numpy(spk))
            for ids, mask, spk in arrays]


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value) -> None:
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
