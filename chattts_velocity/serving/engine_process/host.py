"""The engine process's side: ``engine_main`` loads the model and serves its fronts with an ``EngineHost``.

Why a process of its own: a Python process runs one thread at a time (the GIL). In one process the event loop's
HTTP and encoding work and the engine thread's steps and audio rounds take turns, and every device wait of the
engine thread hands the GIL to the loop, which the engine thread then waits to get back
(`python benchmarks/serve_timeline.py --http`; docs/perf/). Apart, each has a GIL of its own.

The engine process ignores SIGINT and SIGTERM: its fronts drain and then stop it, and it exits once every front
said stop or went away (a front that leaves has its requests and calls cancelled)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.connection as mp_connection
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from ...engine.async_engine import STALL_S
from ...timeline import traced
from ..load import load_chat
from ..local import LocalClient
from .messages import (
    BEAT_S,
    AddFront,
    Beat,
    Call,
    Cancel,
    Collect,
    Collected,
    EngineEnds,
    ErrorKind,
    Failed,
    PeerMetrics,
    Ready,
    Refine,
    RegisterVoice,
    Reply,
    Start,
    Stats,
    Stop,
    VoiceAdded,
)
from .shipper import Front, Shipper

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """What the engine process takes of the serve settings."""

    voices_dir: str | None = None
    """Where registered voices are kept (``VoiceRegistry``'s folder)."""
    audio_round_ms: float | None = None
    """The audio pump's pacing (``load_chat``); None: the pipeline's default."""
    audio_thread: bool = True
    """The audio pump's rounds on a thread of their own (``load_chat``; ``ServerConfig.audio_thread``)."""
    warmup: bool | None = None
    """``load_chat``'s warm-up; None: on CUDA."""
    threads: int | None = None
    """torch's intra-op threads; None: torch's default."""
    log_level: str = "info"
    stall_s: float = STALL_S
    """The engine is unhealthy (its beats say so) once it has had work this long without finishing a step."""


def engine_main(load: dict, settings: EngineSettings, ends: list[EngineEnds],
                backlog: Callable[[], bool] | None = None) -> None:
    """The engine process: ``load_chat(load)``, then serve the fronts at the other ends of ``ends``;
    ``backlog``: as ``RemoteClient.start_engine``'s."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the fronts own the lifetime (a Ctrl-C reaches the group)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(levelname)s [engine process] %(name)s: %(message)s")
    chat = load_chat(load, settings.warmup, settings.audio_round_ms, settings.threads, settings.audio_thread)
    if backlog is not None:
        chat.engine.set_backlog(backlog)
    host = EngineHost(LocalClient(chat, settings.voices_dir, owns_chat=True, stall_s=settings.stall_s), ends)
    host.announce()
    host.start_beating()
    try:
        host.serve()
    finally:
        host.client.close()


@dataclass
class _Gather:
    """A ``PeerMetrics`` call waiting for the other fronts' ``Collected``."""

    waiting: set[int]
    done: asyncio.Future
    got: dict[int, list] = field(default_factory=dict)


class EngineHost:
    """Serves one engine (``client``) to fronts over pipes: starts their requests and ships the audio
    (``Shipper``), answers their calls on an event loop of its own (a refine pass waits for the engine), and
    relays what the fronts share: registered voices, and each other's request metrics. Request and call ids
    come from the fronts, each with its own prefix, so they are unique across fronts."""

    def __init__(self, client: LocalClient, ends: list[EngineEnds]):
        self.client = client
        self.fronts = [Front(i, e) for i, e in enumerate(ends)]
        self.shipper = Shipper()
        self._lock = threading.Lock()  # guards ``_running``
        self._running: dict[str, tuple[Front, Future]] = {}  # call id -> its front and its task
        self._gathers: dict[tuple[int, str], _Gather] = {}  # the calls loop's alone
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="chattts-velocity-calls", daemon=True).start()
        self._handlers = {Start: self._start, Cancel: self._cancel, Call: self._call, Collected: self._collected,
                          Stop: self._leave, AddFront: self._add_front}
        self._calls = {Refine: self._refine, RegisterVoice: self._register, Stats: self._stats,
                       PeerMetrics: self._peer_metrics}

    def announce(self) -> None:
        """Tell every front the engine is ready, with what it prepares requests from."""
        for front in self.fronts:
            front.send(Ready(self.client.info, self.client.kit))

    def start_beating(self) -> None:
        """Send every open front a ``Beat`` every ``BEAT_S`` until they all left: a front that stops hearing
        them knows this process hangs (or was stopped), which no pipe would tell it."""

        def beat() -> None:
            while any(front.open for front in self.fronts):
                health = self.client.health()
                for front in self.fronts:
                    if front.open:
                        front.send(Beat(health))
                time.sleep(BEAT_S)

        threading.Thread(target=beat, name="chattts-velocity-beat", daemon=True).start()

    def serve(self) -> None:
        """Handle the fronts' messages until every front said stop or went away."""
        try:
            while any(front.open for front in self.fronts):
                by_conn = {front.ends.cmd: front for front in self.fronts if front.open}  # fronts may be replaced
                for conn in mp_connection.wait(list(by_conn)):
                    if not by_conn[conn].open:  # replaced within this pass
                        continue
                    msg = self._receive(by_conn[conn])
                    if msg is not None:
                        self.dispatch(by_conn[conn], msg)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _receive(self, front: Front):
        """``front``'s next message; ``Stop`` if it is gone, None if the message could not be read."""
        try:
            return front.ends.cmd.recv()
        except (EOFError, OSError):
            return Stop()
        except Exception:  # noqa: BLE001 - a message that does not unpickle: that one is lost
            logger.exception("front %d sent a message that could not be read", front.index)
            return None

    def dispatch(self, front: Front, msg) -> None:
        """Handle one of ``front``'s messages; an unknown one, or a handler's error, is logged, not fatal."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.error("front %d sent an unknown message %s: ignored", front.index, type(msg).__name__)
            return
        try:
            handler(front, msg)
        except Exception:  # noqa: BLE001 - the other requests and fronts go on
            logger.exception("handling %s from front %d failed", type(msg).__name__, front.index)

    # ---------------------------------------------------------------- requests
    @traced("request arrives", lambda a, k, r: {"prompts": len(a[2].prompts)})
    def _start(self, front: Front, msg: Start) -> None:
        """A request the front prepared and validated: its audio starts now. Should the engine refuse it all
        the same, its audio ends with the error (its headers are out)."""
        try:
            audio = self.client.start([p.prompt() for p in msg.prompts], msg.params, msg.in_flight)
        except Exception as e:  # noqa: BLE001 - the request's failure, not the engine process's
            logger.warning("request %s refused: %s", msg.rid, e)
            front.send(Failed(msg.rid, f"{type(e).__name__}: {e}"))
            return
        self.shipper.add(msg.rid, audio, front)

    def _cancel(self, front: Front, msg: Cancel) -> None:
        if self.shipper.cancel(msg.key):
            return
        with self._lock:
            entry = self._running.get(msg.key)
        if entry is not None:
            entry[1].cancel()  # a refine pass closes its engine stream

    def _leave(self, front: Front, msg: Stop) -> None:
        """``front`` is gone: cancel its requests and calls, and stop waiting for its metrics."""
        front.open = False
        self.shipper.cancel_front(front)
        with self._lock:
            calls = [future for owner, future in self._running.values() if owner is front]
        for future in calls:
            future.cancel()
        self._loop.call_soon_threadsafe(self._forget, front.index)

    def _add_front(self, front: Front, msg: AddFront) -> None:
        """A new front in place of one whose process died: it is told what the others were (ready, and the
        voices registered so far)."""
        old = self.fronts[msg.index]
        if old.open:  # its pipes' end not read yet
            self._leave(old, Stop())
        old.ends.close()
        new = self.fronts[msg.index] = Front(msg.index, msg.ends)
        new.send(Ready(self.client.info, self.client.kit))
        for voice in self.client.voices.registered():
            new.send(VoiceAdded(voice))
        logger.info("front %d replaced (asked by front %d)", msg.index, front.index)

    # ---------------------------------------------------------------- calls
    def _call(self, front: Front, msg: Call) -> None:
        """Run a call on the calls loop; its ``Reply`` goes out when it is done (none if cancelled)."""
        handler = self._calls.get(type(msg.call))
        if handler is None:
            logger.error("front %d made an unknown call %s", front.index, type(msg.call).__name__)
            front.send(Reply(msg.cid, f"unknown call {type(msg.call).__name__}", ErrorKind.INTERNAL))
            return
        future = asyncio.run_coroutine_threadsafe(handler(front, msg), self._loop)
        with self._lock:
            self._running[msg.cid] = front, future
        future.add_done_callback(lambda done: self._reply(front, msg.cid, done))

    def _reply(self, front: Front, cid: str, future: Future) -> None:
        with self._lock:
            self._running.pop(cid, None)
        if future.cancelled():  # the front stopped waiting for it
            return
        error = future.exception()
        if error is None:
            reply = Reply(cid, future.result())
        elif isinstance(error, ValueError):
            reply = Reply(cid, str(error), ErrorKind.INPUT)
        else:
            logger.error("call %s failed", cid, exc_info=error)
            reply = Reply(cid, str(error), ErrorKind.INTERNAL)
        front.send(reply)

    async def _refine(self, front: Front, msg: Call) -> list[str]:
        return await self.client.refine(msg.call.texts, msg.call.params)

    async def _register(self, front: Front, msg: Call):
        voice = await self.client.register_voice(msg.call.name, msg.call.wav, msg.call.transcript)
        for other in self.fronts:  # every front resolves it from now on, with or without a voices folder
            if other is not front and other.open:
                other.send(VoiceAdded(voice))
        return voice

    async def _stats(self, front: Front, msg: Call):
        return await self.client.stats()

    async def _peer_metrics(self, front: Front, msg: Call) -> list:
        """Every other open front's ``Collected`` families: each is asked, and the reply goes once all
        answered or left."""
        key = front.index, msg.cid
        gather = _Gather({f.index for f in self.fronts if f.open and f is not front}, self._loop.create_future())
        self._gathers[key] = gather
        for index in list(gather.waiting):
            self.fronts[index].send(Collect(key))
        try:
            if gather.waiting:
                await gather.done
        finally:
            del self._gathers[key]
        return list(gather.got.values())

    def _collected(self, front: Front, msg: Collected) -> None:
        self._loop.call_soon_threadsafe(self._gathered, msg.key, front.index, msg.families)

    def _gathered(self, key: tuple[int, str], index: int, families: list | None) -> None:
        gather = self._gathers.get(key)
        if gather is None or index not in gather.waiting:
            return
        gather.waiting.discard(index)
        if families is not None:
            gather.got[index] = families
        if not gather.waiting and not gather.done.done():
            gather.done.set_result(None)

    def _forget(self, index: int) -> None:
        for key in list(self._gathers):
            self._gathered(key, index, None)
