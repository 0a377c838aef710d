"""Voices a request may name: OpenAI's voice names, each a fixed built-in speaker; ChatTTS speaker strings; and
voices registered from an uploaded sample (its DVAE codes and transcript), kept in a folder across restarts and,
under Ray Serve, published to a store every replica reads. A front without the model resolves voices from the
speaker statistics alone; only registering needs the model's sample encoder."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
import soundfile as sf
import torch

from ..constants import SAMPLE_RATE
from ..text import encode_speaker, speaker_vector

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                 "marin", "cedar")
"""Each maps to the speaker drawn from the checkpoint's speaker statistics with seed = its index here."""

_ID = re.compile(r"^voice_[0-9a-f]{16}$")
MIN_SAMPLE_S = 0.5
MAX_SAMPLE_S = 60.0

logger = logging.getLogger(__name__)


class UnknownVoiceError(LookupError):
    """No voice of that name or id (the server answers 404)."""


@dataclass(frozen=True)
class Voice:
    """What a request's ``voice`` resolves to: a speaker vector string and/or a voice sample."""

    id: str
    name: str
    spk_emb: str | None = None
    """Speaker string (``Chat.sample_random_speaker``)."""
    spk_smp: str | None = None
    """Voice-sample codes (``Chat.sample_audio_speaker``) ..."""
    txt_smp: str | None = None
    """... and what is said in it."""


class SharedVoices(Protocol):
    """Registered voices shared by several servers (Ray Serve replicas), as ``asdict(Voice)`` records. Its
    calls may block: the registry is used from worker threads only."""

    def put(self, record: dict) -> None: ...

    def all(self) -> list[dict]: ...


class VoiceRegistry:
    """Built-in, registered and inline voices. Thread-safe; registered voices are JSON files in ``folder``
    and, with ``shared``, records every other replica finds."""

    def __init__(self, speaker_stats, hidden_size: int, folder: str | None = None, shared: SharedVoices | None = None,
                 encode: Callable[[np.ndarray], str] | None = None):
        """``speaker_stats``: the checkpoint's ``SpeakerStats`` (None: every built-in voice is the model's
        default); ``hidden_size``: the model's, which an inline speaker string must match; ``encode``: a
        24 kHz sample -> its ``spk_smp`` string (``Chat.sample_audio_speaker``), which ``register`` needs (a
        front without the model registers through its engine and ``remember``s the result)."""
        self.hidden_size = hidden_size
        self.folder = folder
        self.shared = shared
        self.encode = encode
        self._lock = threading.Lock()
        self._builtin = {name: Voice(name, name, spk_emb=_builtin_speaker(speaker_stats, i))
                         for i, name in enumerate(OPENAI_VOICES)}
        self._registered: dict[str, Voice] = {}
        self._unreadable: dict[str, float] = {}  # file -> its mtime when it failed: warned once per version
        if folder:
            os.makedirs(folder, exist_ok=True)
            for file in sorted(os.listdir(folder)):
                voice = self._read(file) if file.endswith(".json") else None
                if voice is not None:
                    self._registered[voice.id] = voice

    def list(self) -> list[Voice]:
        with self._lock:
            return [*self._builtin.values(), *self._registered.values()]

    def registered(self) -> list[Voice]:
        """The voices registered (here or elsewhere), not the built-in ones."""
        with self._lock:
            return list(self._registered.values())

    def resolve(self, voice) -> Voice:
        """A voice name or id, ``{"id": ...}``, or a ChatTTS speaker string."""
        key = voice.get("id") if isinstance(voice, dict) else voice
        if not isinstance(key, str) or not key:
            raise UnknownVoiceError(f"voice must be a name, an id or {{'id': ...}}, got {voice!r}")
        if _ID.match(key) and key not in self._registered:
            self.reload()  # registered by another process sharing the folder or the store
        with self._lock:
            found = self._builtin.get(key.lower()) or self._registered.get(key)
        if found is not None:
            return found
        if len(key) > 64:  # a speaker string: decodes, or it is a malformed one
            try:
                speaker_vector(key, self.hidden_size)
            except ValueError as e:
                raise UnknownVoiceError(f"voice is neither a known voice nor a valid speaker string: {e}") from None
            return Voice("inline", "inline", spk_emb=key)
        raise UnknownVoiceError(f"unknown voice {key!r}: GET /v1/audio/voices lists them")

    def register(self, name: str, wav: np.ndarray, transcript: str) -> Voice:
        """A new voice from a 24 kHz mono float sample and its transcript, stored (folder, shared store)."""
        if not transcript.strip():
            raise ValueError("transcript is empty: give the text spoken in the sample")
        if self.encode is None:
            raise RuntimeError("this registry has no sample encoder: register through EngineClient.register_voice")
        spk_smp = self.encode(wav)
        voice = Voice(f"voice_{uuid.uuid4().hex[:16]}", name or "custom", spk_smp=spk_smp, txt_smp=transcript.strip())
        with self._lock:
            self._registered[voice.id] = voice
            if self.folder:
                path = os.path.join(self.folder, f"{voice.id}.json")
                tmp = path + ".tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(asdict(voice), f)
                os.replace(tmp, path)  # never a half-written voice
        if self.shared is not None:
            self.shared.put(asdict(voice))
        return voice

    def remember(self, voice: Voice) -> None:
        """Know a voice registered elsewhere (another process's ``register``, which stored it)."""
        with self._lock:
            self._registered[voice.id] = voice

    def reload(self) -> None:
        """Pick up voices other processes registered: in the folder (several servers may share it) and in the
        shared store."""
        found = []
        for file in os.listdir(self.folder) if self.folder else ():
            vid = file.removesuffix(".json")
            if file.endswith(".json") and _ID.match(vid) and vid not in self._registered:
                voice = self._read(file)
                if voice is not None:
                    found.append(voice)
        if self.shared is not None:
            found += [Voice(**record) for record in self.shared.all() if record["id"] not in self._registered]
        with self._lock:
            for voice in found:
                self._registered.setdefault(voice.id, voice)

    def _read(self, file: str) -> Voice | None:
        """The voice in ``file`` of the folder, or None (with a warning naming it, once per version of the
        file) if it cannot be read: one bad file must not take the other voices, or the server, down."""
        path = os.path.join(self.folder, file)
        try:
            mtime = os.path.getmtime(path)
        except OSError:  # gone meanwhile
            return None
        if self._unreadable.get(file) == mtime:
            return None
        try:
            with open(path, encoding="utf-8") as f:
                return Voice(**json.load(f))
        except (OSError, ValueError, TypeError) as e:  # unreadable, not JSON (or not UTF-8), not a voice record
            self._unreadable[file] = mtime
            logger.warning("skipping voice file %s: %s", path, e)
            return None


def _builtin_speaker(stats, seed: int) -> str | None:
    if stats is None:  # a checkpoint without speaker statistics: the default voice for all
        return None
    return encode_speaker(stats.sample(torch.Generator().manual_seed(seed)))


def read_sample(data: bytes, max_bytes: int | None = None, max_seconds: float = MAX_SAMPLE_S) -> np.ndarray:
    """An uploaded audio file (any format ffmpeg reads) -> 24 kHz mono float32 samples. Its size and, where the
    file's header says it, its duration are checked before any decoding; decoding stops once past
    ``max_seconds``."""
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"the uploaded audio file has {len(data)} bytes, at most {max_bytes} are allowed")
    seconds = _header_seconds(data)
    if seconds is not None:
        _check_duration(seconds, max_seconds)
    wav = _decode(data, int(max_seconds * SAMPLE_RATE) + 1)
    _check_duration(wav.size / SAMPLE_RATE, max_seconds)
    return wav


def _check_duration(seconds: float, max_seconds: float) -> None:
    if not MIN_SAMPLE_S <= seconds <= max_seconds:
        raise ValueError(f"the audio sample must last between {MIN_SAMPLE_S:g} and {max_seconds:g} s, "
                         f"got {seconds:.2f} s")


def _header_seconds(data: bytes) -> float | None:
    """The duration a file's header states (soundfile's formats), or None: unknown format or length."""
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        return None
    if info.samplerate <= 0 or not 0 < info.frames < 1 << 62:  # a streamed file may state no length
        return None
    return info.frames / info.samplerate


def _decode(data: bytes, max_samples: int) -> np.ndarray:
    """The file's audio as 24 kHz mono float32, decoded no further than just past ``max_samples``."""
    import av  # an optional dependency (the server's)

    parts, size = [], 0
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise ValueError("the uploaded audio file has no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(audio=0):
                new = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
                parts += new
                size += sum(p.size for p in new)
                if size > max_samples:  # too long already: the check after says so
                    break
            else:
                parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    except av.error.FFmpegError as e:
        raise ValueError(f"the uploaded audio could not be decoded: {e}") from None
    return (np.concatenate(parts) if parts else np.zeros(0)).astype(np.float32)
