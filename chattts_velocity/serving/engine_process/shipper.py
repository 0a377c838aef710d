"""The engine process's audio shipper: one thread sends every request's ready chunks to its front, all of one
front's requests' chunks of a pass in one message (a message per chunk would cost the engine process a pickle
and a write each, under the GIL its engine thread needs), their samples written from the chunks' own memory
(``messages.send_audio``)."""

from __future__ import annotations

import contextlib
import logging
import threading

from ...audio.pump import take_ready
from ..client import RequestAudio
from .messages import AudioBatch, AudioItem, EngineEnds, send_audio

logger = logging.getLogger(__name__)


class Front:
    """One front's pipe ends, as the engine process holds them: commands come on ``ends.cmd``; replies,
    refusals and relays go on ``ends.events`` (``send``), the requests' audio on ``ends.audio`` (the
    shipper's alone)."""

    def __init__(self, index: int, ends: EngineEnds):
        self.index, self.ends = index, ends
        self.open = True
        """False once the front said stop or its pipe closed."""
        self._lock = threading.Lock()

    def send(self, msg) -> None:
        """Send ``msg`` on the events pipe; a front that went away misses it."""
        try:
            with self._lock:
                self.ends.events.send(msg)
        except (OSError, EOFError, ValueError):
            pass


class Shipper:
    """Requests' audio in flight, each read (``take_ready``) when it has news and shipped to its front."""

    def __init__(self):
        self._cond = threading.Condition()  # guards the two below
        self._audio: dict[str, tuple[RequestAudio, Front]] = {}
        self._due: dict[str, None] = {}  # requests with news, in order
        threading.Thread(target=self._run, name="chattts-velocity-ship", daemon=True).start()

    def add(self, rid: str, audio: RequestAudio, front: Front) -> None:
        """Ship ``audio``'s chunks to ``front`` as they come. Its engine requests are submitted here, not at the
        shipper's first read of it: that read waits for the shipper's pass, which may be writing to a front
        that is busy taking new requests (a burst of clients starting together) while the engine idles. The
        shipper sees the audio only once ``start`` returned: a read while it runs (woken by its first chunk)
        would race it."""
        audio.on_ready(lambda: self._mark(rid))
        try:
            audio.start()
        except Exception:  # noqa: BLE001 - the first read meets it again, and the request fails with it there
            pass
        with self._cond:
            self._audio[rid] = audio, front
        self._mark(rid)

    def cancel(self, rid: str) -> bool:
        """Cancel a request's audio; False if it is not (or no longer) shipped here."""
        with self._cond:
            entry = self._audio.pop(rid, None)
        if entry is None:
            return False
        entry[0].cancel()  # thread-safe, even while the shipper is inside its ``next``
        return True

    def cancel_front(self, front: Front) -> None:
        with self._cond:
            rids = [rid for rid, (_, owner) in self._audio.items() if owner is front]
        for rid in rids:
            self.cancel(rid)

    def _mark(self, rid: str) -> None:
        with self._cond:
            self._due[rid] = None
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
                due, self._due = list(self._due), {}
                entries = [(rid, self._audio.get(rid)) for rid in due]
            batches: dict[Front, list[AudioItem]] = {}
            for rid, entry in entries:
                if entry is None:
                    continue
                out = batches.setdefault(entry[1], [])
                try:
                    self._take(rid, *entry, out)
                except Exception as e:  # noqa: BLE001 - that request fails; the others' audio goes on
                    logger.exception("shipping request %s's audio failed", rid)
                    out.append(AudioItem(rid, None, f"{type(e).__name__}: {e}"))
                    with self._cond:
                        self._audio.pop(rid, None)
                    with contextlib.suppress(Exception):  # its engine requests end (unless that is what failed)
                        entry[0].cancel()
            for front, items in batches.items():
                if items and front.open:
                    try:
                        send_audio(front.ends.audio, AudioBatch(items))
                    except (OSError, EOFError):  # the front is gone: the host cancels its requests
                        pass
                    except ValueError:  # (a pass's audio past one message's size: never seen)
                        logger.exception("shipping audio to front %d failed", front.index)

    def _take(self, rid: str, audio: RequestAudio, front: Front, out: list[AudioItem]) -> None:
        """Add what ``audio`` has ready to ``out``: its chunks as one, then its end if it ended."""
        chunk, end, failure = take_ready(audio)
        if failure is not None:
            logger.warning("request %s failed: %s", rid, failure)
        if chunk is not None:
            out.append(AudioItem(rid, chunk))
        if end:
            out.append(AudioItem(rid, None, None if failure is None else str(failure) or type(failure).__name__))
            with self._cond:
                self._audio.pop(rid, None)
            audio.cancel()
