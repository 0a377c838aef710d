"""``RefineTextParams`` / ``InferCodeParams``: upstream ChatTTS's names and defaults, validated before any work.
Numbers may be Python or numpy scalars; every bound is what the sampler can represent (``sampling.limits``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .sampling.limits import (
    MAX_COUNT,
    MAX_PENALTY,
    MAX_TEMPERATURE,
    MIN_PENALTY,
    MIN_TEMPERATURE,
    is_int,
    is_num,
    plain,
    short,
)

_NUMERIC = ("top_P", "top_K", "temperature", "repetition_penalty", "max_new_token", "min_new_token", "manual_seed",
            "stream_batch", "stream_speed", "pass_first_n_batches")


@dataclass(repr=False, eq=False)
class RefineTextParams:
    """Settings of the text-refine pass (upstream defaults)."""

    prompt: str = ""
    top_P: float = 0.7
    top_K: int = 20
    temperature: float = 0.7
    repetition_penalty: float = 1.0
    max_new_token: int = 384
    min_new_token: int = 0
    show_tqdm: bool = True
    ensure_non_empty: bool = True
    manual_seed: int | None = None

    def validate(self, num_vq: int = 4, vocab: int | None = None) -> None:
        """Raise ``ValueError`` naming the first out-of-range field and its allowed range; ``vocab`` (the ids the
        pass samples from) bounds ``top_K``."""
        if not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be a str, got {type(self.prompt).__name__}")
        temps = self.temperature if isinstance(self.temperature, (list, tuple)) else [self.temperature]
        if isinstance(self.temperature, (list, tuple)) and len(temps) != num_vq:
            raise ValueError(f"temperature list must have {num_vq} entries (one per codebook), got {len(temps)}")
        for t in temps:
            _check(is_num(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE, "temperature", t,
                   f"a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
        if self.top_P is not None:
            _check(is_num(self.top_P) and 0 < self.top_P <= 1, "top_P", self.top_P, "a number in (0, 1] or None")
        if self.top_K is not None:
            top = MAX_COUNT if vocab is None else vocab
            _check(is_int(self.top_K) and 1 <= self.top_K <= top, "top_K", self.top_K,
                   f"an int in [1, {top}] or None (None keeps every id)")
        if self.repetition_penalty is not None:
            _check(is_num(self.repetition_penalty) and MIN_PENALTY <= self.repetition_penalty <= MAX_PENALTY,
                   "repetition_penalty", self.repetition_penalty,
                   f"a number in [{MIN_PENALTY:g}, {MAX_PENALTY:g}] or None (1 or None: no penalty)")
        _check(is_int(self.max_new_token) and 1 <= self.max_new_token <= MAX_COUNT, "max_new_token",
               self.max_new_token, f"an int in [1, {MAX_COUNT}]")
        _check(is_int(self.min_new_token) and 0 <= self.min_new_token <= self.max_new_token,
               "min_new_token", self.min_new_token, f"an int in [0, max_new_token={self.max_new_token}]")
        if self.manual_seed is not None:
            _check(is_int(self.manual_seed) and 0 <= self.manual_seed < 2**63, "manual_seed", self.manual_seed,
                   "None or an int in [0, 2**63)")

    def checked(self, num_vq: int = 4, vocab: int | None = None) -> RefineTextParams:
        """``validate``, then a copy whose numbers are plain Python ones (numpy scalars converted); the
        original is not changed."""
        self.validate(num_vq, vocab)
        changes = {name: plain(getattr(self, name)) for name in _NUMERIC if hasattr(self, name)}
        return dataclasses.replace(self, **changes)

    def temperatures(self, n: int) -> tuple[float, ...]:
        """The temperature per codebook (or the single text temperature for n=1)."""
        if isinstance(self.temperature, (list, tuple)):
            return tuple(float(t) for t in self.temperature)
        return (float(self.temperature),) * n


@dataclass(repr=False, eq=False)
class InferCodeParams(RefineTextParams):
    """Settings of the audio-code pass (upstream defaults). ``spk_emb`` is a speaker string
    (``sample_random_speaker``); ``spk_smp``/``txt_smp`` a voice sample and its transcript."""

    prompt: str = "[speed_5]"
    spk_emb: str | None = None
    spk_smp: str | None = None
    txt_smp: str | None = None
    temperature: float = 0.3
    repetition_penalty: float = 1.05
    max_new_token: int = 2048
    stream_batch: int = 24
    stream_speed: int = 12000
    pass_first_n_batches: int = 2

    def validate(self, num_vq: int = 4, vocab: int | None = None) -> None:
        super().validate(num_vq, vocab)
        for name, low in (("stream_batch", 1), ("stream_speed", 1), ("pass_first_n_batches", 0)):
            value = getattr(self, name)
            _check(is_int(value) and low <= value <= MAX_COUNT, name, value, f"an int in [{low}, {MAX_COUNT}]")
        for name in ("spk_smp", "txt_smp"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), name, type(value).__name__, "None or a str")


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={short(value)} is out of range: must be {allowed}")
