"""Voices of the web demo: timbre presets (seeds of random speakers, as in upstream's web UI), the speaker
string of a seed, and the voice-sample code of an uploaded recording."""

from __future__ import annotations

import numpy as np
import torch

from chattts_velocity.chat import Chat
from chattts_velocity.constants import SAMPLE_RATE
from chattts_velocity.text import encode_speaker

TIMBRES = {"Default": 2, **{f"Timbre{i}": 1111 * i for i in range(1, 10)}}
"""Preset timbre seeds: the same names and seeds as upstream's web UI, so a preset gives its voice."""

SEED_RANGE = (1, 4294967295)
"""Seeds the dice draw from (upstream's range)."""


def speaker_for_seed(chat: Chat, seed: int) -> str:
    """The speaker string drawn from the checkpoint's speaker statistics with ``seed``: the voice upstream
    gives for ``torch.manual_seed(seed); sample_random_speaker()``, drawn without touching the global RNG
    (other visitors' threads use it). Blank if the checkpoint has no speaker statistics (its default voice)."""
    stats = chat.model.speaker_stats
    if stats is None:
        return ""
    return encode_speaker(stats.sample(torch.Generator().manual_seed(int(seed))))


def sample_code(chat: Chat, audio: tuple[int, np.ndarray], max_seconds: float) -> str:
    """The voice-sample string (``spk_smp``) of an uploaded recording: Gradio's (rate, samples) with int or
    float samples, mono or [n, channels], resampled to 24 kHz mono. ``ValueError`` if it is not 0.5 s to
    ``max_seconds`` long."""
    rate, data = audio
    wav = np.asarray(data)
    if wav.dtype.kind in "iu":
        info = np.iinfo(wav.dtype)
        wav = (wav.astype(np.float32) - (info.max + info.min + 1) / 2) / ((info.max - info.min + 1) / 2)
    wav = wav.astype(np.float32)
    if wav.ndim == 2:
        wav = wav.mean(axis=1)
    seconds = wav.size / rate if rate > 0 else 0.0
    if not 0.5 <= seconds <= max_seconds:
        raise ValueError(f"the voice sample must last between 0.5 and {max_seconds:g} s, got {seconds:.2f} s")
    if rate != SAMPLE_RATE:
        import torchaudio.functional as AF

        wav = AF.resample(torch.from_numpy(wav), rate, SAMPLE_RATE).numpy()
    return chat.sample_audio_speaker(wav)
