"""Clocks, memory meters and the figures of one (path, batch) variant, computed from raw clock readings."""

from __future__ import annotations

import gc
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..constants import SAMPLE_RATE, SAMPLES_PER_TOKEN

TTFA_TOKENS = 24
"""Tokens of the first audio chunk (upstream's ``stream_batch``: 24 tokens = 0.512 s of audio)."""

DEFINITIONS = {
    "step_ms_p50": "median wall time of one decode step (prefill excluded), all running sequences advancing",
    "steps_per_s": "decode steps per second per sequence: generated tokens per sequence / gpt_s",
    "tokens_per_s": "generated tokens per second, all sequences together: generated_tokens / gpt_s",
    "gpt_audio_s_per_s": "audio seconds generated per wall second of the GPT alone (tokens_per_s / 46.875)",
    "e2e_audio_s_per_s": (
        "audio seconds per wall second including the wav decode: audio_s / (gpt_s + decode_s)"
    ),
    "ttfa_s": (
        "time to first audio: from submitting the batch until the first request has "
        f"min({TTFA_TOKENS}, tokens) tokens and those are decoded to a wav through Decoder+Vocos "
        "(ttfa_generate_s + ttfa_decode_s; the prefix is decoded right after the run, on an idle device)"
    ),
    "ttfa_generate_s": "the generation part of ttfa_s",
    "ttfa_decode_s": "the wav-decode part of ttfa_s",
    "prefill_s": "from submitting the batch until every sequence has its first token",
    "gpt_s": "from submitting the batch until the last token (prompt embedding, prefill, all decode steps)",
    "decode_s": "Decoder+Vocos over all sequences to float32 wavs on the host, in chunks of decode_batch",
    "peak_mem_gib": "see meta.peak_mem_kind",
}


class Clock:
    """Wall time read after the device has finished all queued work, so a reading covers that work."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class MemoryMeter:
    """Peak memory of one variant: allocated CUDA memory (reset per variant), or the process's max RSS on CPU,
    which the OS never resets, so on CPU it is the peak of the whole run so far."""

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def kind(self) -> str:
        if self.device.type == "cuda":
            return "torch.cuda.max_memory_allocated during the variant's timed runs (model weights included)"
        return "process max RSS since start (ru_maxrss; the OS does not reset it between variants)"

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # bytes on macOS, KiB on Linux


@dataclass
class GenerationTiming:
    """Clock readings of one generation run, in seconds from submitting the batch."""

    gpt_s: float
    prefill_s: float
    first_chunk_s: float
    """The first request has ``min(TTFA_TOKENS, tokens)`` tokens."""
    decode_steps_s: list[float]
    """Duration of every decode step after the prefill."""
    hiddens: list[Tensor]
    """Per sequence, the hidden states [T_i, H] that produced its tokens (what the Decoder decodes)."""


@dataclass
class AudioTiming:
    decode_s: float
    """Decoder+Vocos over every sequence."""
    prefix_decode_s: float
    """Decoder+Vocos over the first request's first chunk."""


def variant_row(
    path: str, dtype: str, batch: int, tokens: int, gen: GenerationTiming, audio: AudioTiming, peak_gib: float
) -> dict:
    """The reported figures of one timed run (see ``DEFINITIONS``)."""
    generated = sum(h.shape[0] for h in gen.hiddens)
    audio_s = generated * SAMPLES_PER_TOKEN / SAMPLE_RATE
    return {
        "path": path,
        "dtype": dtype,
        "batch": batch,
        "tokens": tokens,
        "generated_tokens": generated,
        "step_ms_p50": 1000 * statistics.median(gen.decode_steps_s),
        "steps_per_s": generated / batch / gen.gpt_s,
        "tokens_per_s": generated / gen.gpt_s,
        "gpt_audio_s_per_s": audio_s / gen.gpt_s,
        "e2e_audio_s_per_s": audio_s / (gen.gpt_s + audio.decode_s),
        "ttfa_s": gen.first_chunk_s + audio.prefix_decode_s,
        "ttfa_generate_s": gen.first_chunk_s,
        "ttfa_decode_s": audio.prefix_decode_s,
        "prefill_s": gen.prefill_s,
        "gpt_s": gen.gpt_s,
        "decode_s": audio.decode_s,
        "audio_s": audio_s,
        "peak_mem_gib": peak_gib,
    }


def median_row(rows: list[dict]) -> dict:
    """One row from repeated runs: the median of every measured figure."""
    first = rows[0]
    out = dict(first)
    for key, value in first.items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rows)
    out["repeats"] = len(rows)
    return out


SPEEDUP_KEYS = {
    # velocity / reference for rates, reference / velocity for times: > 1 means velocity is better.
    "step_ms_p50": "time",
    "steps_per_s": "rate",
    "tokens_per_s": "rate",
    "gpt_audio_s_per_s": "rate",
    "e2e_audio_s_per_s": "rate",
    "ttfa_s": "time",
}


def speedup_row(reference: dict, velocity: dict) -> dict:
    """How many times better the velocity engine is than the reference, per figure."""
    row: dict = {"batch": velocity["batch"], "dtype": velocity["dtype"]}
    for key, kind in SPEEDUP_KEYS.items():
        ratio = velocity[key] / reference[key] if kind == "rate" else reference[key] / velocity[key]
        row[key] = ratio
    return row
