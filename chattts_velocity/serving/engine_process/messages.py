"""What crosses the pipes between the engine process and its fronts: one frozen dataclass per message, each side
dispatching on the message's type. Every request kind takes one protocol: a front ``Start``s prompts it
prepared itself and reads their audio; everything else is a ``Call`` answered by one ``Reply``.

Each front has three pipes (``FrontEnds``/``EngineEnds``): commands go down one, and replies, refusals and
relays come back on another than the requests' audio, so that a reply never queues behind a round's audio."""

from __future__ import annotations

import enum
import multiprocessing as mp
import os
import pickle
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ...engine import Prompt, SamplingParams
from ...params import RefineTextParams
from ...timeline import traced
from ..client import EngineInfo
from ..kit import SpeechKit
from ..voices import Voice

BEAT_S = 1.0
"""How often the engine process sends each front a ``Beat``."""


# ============================================================================ front -> engine
class PromptArrays(NamedTuple):
    """A ``Prompt`` as numpy arrays for the pipe: a torch tensor would go as shared memory whose descriptor the
    receiver fetches back from the sender, a round trip per tensor, each needing the sender's GIL."""

    ids: np.ndarray
    text_mask: np.ndarray
    speaker: np.ndarray | None

    @classmethod
    def of(cls, prompt: Prompt) -> PromptArrays:
        speaker = None if prompt.speaker is None else prompt.speaker.numpy()
        return cls(prompt.ids.numpy(), prompt.text_mask.numpy(), speaker)

    def prompt(self) -> Prompt:
        speaker = None if self.speaker is None else torch.from_numpy(self.speaker)
        return Prompt(torch.from_numpy(self.ids), torch.from_numpy(self.text_mask), speaker)


@dataclass(frozen=True, slots=True)
class Start:
    """Run prepared prompts as one joined audio stream (``EngineClient.start``); no answer unless refused."""

    rid: str
    prompts: list[PromptArrays]
    params: SamplingParams
    in_flight: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop a request's audio, or a call still running (the front stopped waiting for it)."""

    key: str


@dataclass(frozen=True, slots=True)
class Refine:
    texts: list[str]
    params: RefineTextParams


@dataclass(frozen=True, slots=True, eq=False)
class RegisterVoice:
    name: str
    wav: np.ndarray
    transcript: str


@dataclass(frozen=True, slots=True)
class Stats:
    """The engine's ``EngineStats``."""


@dataclass(frozen=True, slots=True)
class PeerMetrics:
    """Every other front's request metrics (each answers a ``Collect``)."""


CallKind = Refine | RegisterVoice | Stats | PeerMetrics


@dataclass(frozen=True, slots=True)
class Call:
    cid: str
    call: CallKind


@dataclass(frozen=True, slots=True)
class Collected:
    """A front's answer to ``Collect``: its ``Metrics.own`` families (None: it could not collect them)."""

    key: tuple[int, str]
    families: list | None


@dataclass(frozen=True, slots=True)
class AddFront:
    """From the first front: serve a new front ``index`` (one that replaces a front process which died) over
    these pipe ends (passed as descriptors)."""

    index: int
    ends: EngineEnds


@dataclass(frozen=True, slots=True)
class Stop:
    """The front is done: cancel its requests and stop serving it."""


# ============================================================================ engine -> front: events
@dataclass(frozen=True, slots=True)
class Ready:
    """The model is loaded: what the front prepares requests with."""

    info: EngineInfo
    kit: SpeechKit


class ErrorKind(enum.Enum):
    """How a call failed, raised again in the front as ``exception``."""

    INPUT = "input"
    """Bad input (a ``ValueError``: the front answers 400)."""
    INTERNAL = "internal"

    def exception(self, message: str) -> Exception:
        return ValueError(message) if self is ErrorKind.INPUT else RuntimeError(message)


@dataclass(frozen=True, slots=True)
class Reply:
    """A ``Call``'s result; with ``error`` set, ``value`` is the error's message."""

    cid: str
    value: object = None
    error: ErrorKind | None = None

    def result(self) -> object:
        if self.error is not None:
            raise self.error.exception(str(self.value))
        return self.value


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine refused a started request (its headers are out: its audio ends with this)."""

    rid: str
    message: str


@dataclass(frozen=True, slots=True)
class Collect:
    """Another front's ``PeerMetrics`` asks this one's metrics (answered with ``Collected``)."""

    key: tuple[int, str]


@dataclass(frozen=True, slots=True)
class Beat:
    """The engine process is alive (sent every ``BEAT_S``), with its engine's health: None while it serves, else
    why not (``EngineClient.health``)."""

    health: str | None = None


@dataclass(frozen=True, slots=True)
class VoiceAdded:
    """Another front registered a voice."""

    voice: Voice


# ============================================================================ engine -> front: audio
class AudioItem(NamedTuple):
    """A request's chunk, or (``chunk`` None) its end, with why it failed (None if it did not). A tuple: a
    round carries one per stream, and a tuple pickles cheapest."""

    rid: str
    chunk: np.ndarray | None
    failure: str | None = None


@dataclass(frozen=True, slots=True)
class AudioBatch:
    """Every chunk one front's requests had ready in one shipper pass."""

    items: list[AudioItem]


@traced("ship audio", lambda a, k, r: {"items": len(a[1].items)})
def send_audio(conn, batch: AudioBatch) -> None:
    """Send ``batch`` on an audio pipe (``recv_audio`` reads it): its chunks' samples out of band (pickle
    protocol 5), written from the arrays' own memory with the rest in one ``writev``, so the engine process
    copies no sample under the GIL its engine thread needs (pickled whole, every chunk was copied twice). Two
    messages in the pipe's framing: the buffers' sizes with the pickled rest, then the samples (none without
    any)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    views = [buf.raw() for buf in buffers]
    sizes = [view.nbytes for view in views]
    meta = struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes) + head
    parts = [struct.pack("!i", len(meta)), meta]
    if views:
        if (body := sum(sizes)) > 0x7FFFFFFF:
            raise ValueError(f"an audio batch of {body} bytes is too large for one message")
        parts += [struct.pack("!i", body), *views]
    if not hasattr(os, "writev"):  # (no writev: the pipe's own writes, a message at a time)
        conn.send_bytes(meta)
        if views:
            conn.send_bytes(b"".join(views))
        return
    _write_all(conn.fileno(), parts)


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 16
"""Most buffers one ``writev`` takes."""


def _write_all(fd: int, parts: list) -> None:
    """Write ``parts`` (buffers) to ``fd`` in order with as few ``writev`` calls as the system allows."""
    views = [memoryview(part).cast("B") for part in parts]
    i = 0
    while i < len(views):
        written = os.writev(fd, views[i : i + _IOV_MAX])
        while i < len(views) and written >= views[i].nbytes:
            written -= views[i].nbytes
            i += 1
        if written:  # a partial write: the rest of this buffer next
            views[i] = views[i][written:]


def recv_audio(conn) -> AudioBatch:
    """The next ``AudioBatch`` that ``send_audio`` wrote on ``conn``; its chunks are writable arrays over one
    buffer received in place."""
    meta = conn.recv_bytes()
    (count,) = struct.unpack_from("<I", meta)
    sizes = struct.unpack_from(f"<{count}Q", meta, 4)
    body = bytearray(sum(sizes))
    if count:
        conn.recv_bytes_into(body)
    whole, buffers, at = memoryview(body), [], 0
    for size in sizes:
        buffers.append(whole[at : at + size])
        at += size
    batch = pickle.loads(memoryview(meta)[4 + 8 * count :], buffers=buffers)
    if not isinstance(batch, AudioBatch):
        raise TypeError(f"the audio pipe carried a {type(batch).__name__}")
    return batch


# ============================================================================ the pipes
@dataclass(frozen=True)
class FrontEnds:
    """One front's pipe ends: it sends on ``cmd`` and reads ``events`` and ``audio``."""

    cmd: object
    events: object
    audio: object

    def close(self) -> None:
        for end in (self.cmd, self.events, self.audio):
            end.close()


@dataclass(frozen=True)
class EngineEnds:
    """The engine process's ends of one front's pipes: it reads ``cmd`` and sends on ``events`` and ``audio``."""

    cmd: object
    events: object
    audio: object

    def close(self) -> None:
        for end in (self.cmd, self.events, self.audio):
            end.close()


def open_pipes(fronts: int, ctx=mp) -> tuple[list[EngineEnds], list[FrontEnds]]:
    """The three one-way pipes of each of ``fronts`` fronts, as the engine's ends and the fronts' ends."""
    engine, front = [], []
    for _ in range(fronts):
        cmd_in, cmd = ctx.Pipe(duplex=False)
        events, events_out = ctx.Pipe(duplex=False)
        audio, audio_out = ctx.Pipe(duplex=False)
        engine.append(EngineEnds(cmd_in, events_out, audio_out))
        front.append(FrontEnds(cmd, events, audio))
    return engine, front
