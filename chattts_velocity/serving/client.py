"""The engine seam: what every front (the HTTP routes, the web demo, a Ray replica) needs of an engine, and
nothing of where it runs. ``LocalClient`` serves it from a ``Chat`` in this process; ``RemoteClient``
(``engine_process``) from an engine in a process of its own. Which one a front gets is decided once, at launch;
a front never branches on it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..engine import Prompt, SamplingParams
from ..params import RefineTextParams
from .kit import SpeechKit
from .voices import Voice, VoiceRegistry


class EngineGoneError(RuntimeError):
    """The engine is not running (its process exited or was killed): nothing can be generated."""


class RequestAudio(Protocol):
    """One request's audio as mono float32 chunks at 24 kHz, in order (``pipeline.JoinedAudio`` in this
    process, ``engine_process.RemoteAudio`` over pipes). ``next`` blocks until the next chunk, unless
    ``on_ready`` gave a callback first: then it returns ``pipeline.PENDING`` when none is there yet, and the
    callback (cheap, thread-safe) is called whenever one may be. ``cancel`` from any thread ends it and frees its
    engine work; ``close`` is the same."""

    def __iter__(self) -> Iterator[np.ndarray]: ...

    def __next__(self) -> np.ndarray: ...

    def on_ready(self, notify: Callable[[], None]) -> None: ...

    def start(self) -> None:
        """Put the engine to work now rather than at the first ``next`` (does nothing after it)."""

    def cancel(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineInfo:
    """What a front may want to know of the engine it talks to."""

    device: str
    """Where the model runs (``cuda:0``, ``cpu``)."""
    max_num_seqs: int
    """Sequences the engine decodes together (a front sizes its own concurrency from it)."""


class EngineClient(ABC):
    """A front's handle on one engine. ``kit`` prepares requests without the engine (texts, voices, prompts,
    validation: the same 4xx everywhere); ``start`` runs prepared prompts; the rest are calls."""

    kit: SpeechKit
    info: EngineInfo
    voices: VoiceRegistry
    """Resolves a request's ``voice`` (built-in, registered, inline); ``register_voice`` adds to it."""

    @abstractmethod
    def start(self, prompts: list[Prompt], params: SamplingParams, in_flight: int) -> RequestAudio:
        """Run ``prompts`` (one per sentence, from ``kit``) as one joined audio stream, up to ``in_flight``
        sentences generating at once. Never waits for the engine; ``EngineGoneError`` if it is gone."""

    @abstractmethod
    async def refine(self, texts: list[str], params: RefineTextParams) -> list[str]:
        """The texts after ChatTTS's refine pass (the engine's text mode). Cancelling the awaiting task aborts
        the engine requests."""

    @abstractmethod
    async def register_voice(self, name: str, wav: np.ndarray, transcript: str) -> Voice:
        """Encode a 24 kHz mono voice sample into a voice every front of this engine resolves from now on
        (``ValueError`` for a bad sample or transcript)."""

    @abstractmethod
    async def stats(self):
        """The engine's current ``EngineStats`` (what ``/metrics`` shows)."""

    async def peer_metrics(self) -> list:
        """Request metrics of the other fronts sharing this engine (``Metrics.own`` families each), for a
        ``/metrics`` that sums them; none by default."""
        return []

    def share_metrics(self, own: Callable[[], list]) -> None:
        """Have ``own()`` (this front's ``Metrics.own`` families) answer the other fronts' ``peer_metrics``;
        nothing to do where no other front shares the engine."""
        return None

    def health(self) -> str | None:
        """None while the engine serves; else why it does not."""
        return None

    def close(self) -> None:
        """Stop using the engine (a client that owns it stops it)."""
        return None
