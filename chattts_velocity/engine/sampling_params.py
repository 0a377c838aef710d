"""``SamplingParams``: how one request is decoded. Every request carries its own; a batch mixes them freely."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..sampling.limits import (
    MAX_COUNT,
    MAX_PENALTY,
    MAX_PENALTY_WINDOW,
    MAX_TEMPERATURE,
    MIN_PENALTY,
    MIN_TEMPERATURE,
    PENALTY_WINDOW,
    is_int,
    is_num,
    plain,
    short,
)


class Mode(str, Enum):
    CODE = "code"
    """Audio: each step emits one code per codebook; any codebook's EOS ends the sequence."""
    TEXT = "text"
    """Refine: each step emits one text token."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (ChatTTS's logits chain, in its order)."""

    mode: Mode = Mode.CODE
    """``Mode.CODE`` (audio codes) or ``Mode.TEXT`` (refine)."""
    temperature: tuple[float, ...] = (0.3,)
    """One per codebook (code mode), or one value used for every codebook / the text head."""
    top_p: float | None = 0.7
    """Nucleus mass in (0, 1]; None disables."""
    top_k: int | None = 20
    """Keep the k best (at least 3), k at most the vocabulary; None disables."""
    repetition_penalty: float | None = 1.05
    """ChatTTS penalty over the last ``penalty_window`` generated ids of each codebook; None or 1 disables."""
    penalty_window: int = PENALTY_WINDOW
    """How many recent generated tokens the penalty counts."""
    min_new_tokens: int = 0
    """EOS is masked until this many tokens were generated."""
    max_new_tokens: int = 2048
    """Generation stops (finish reason ``length``) after this many tokens."""
    seed: int | None = None
    """Seeded sampling is batch-invariant: same seed, same output, whatever else runs. None draws a seed
    from Python's ``random`` at ``add_request``."""
    return_hidden_states: bool = True
    """Return the final-norm hidden state of every generated token (what ``use_decoder=True`` decodes)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        temps = self.temperature if isinstance(self.temperature, (tuple, list)) else (self.temperature,)
        object.__setattr__(self, "temperature", tuple(plain(t) for t in temps))
        for name in ("top_p", "top_k", "repetition_penalty", "penalty_window", "min_new_tokens", "max_new_tokens",
                     "seed"):  # numpy scalars as Python numbers, so every later conversion is exact
            object.__setattr__(self, name, plain(getattr(self, name)))

    def validate(self, num_vq: int, vocab: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field and what it accepts. Every field is bounded to what
        the sampler represents (see ``sampling.limits``); ``vocab`` (ids per row) bounds ``top_k``."""
        if len(self.temperature) not in (1, num_vq) or (self.mode is Mode.TEXT and len(self.temperature) != 1):
            allowed = "1 value" if self.mode is Mode.TEXT else f"1 or {num_vq} values"
            raise ValueError(f"temperature must have {allowed}, got {len(self.temperature)}")
        for t in self.temperature:
            _check(is_num(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE, "temperature", t,
                   f"numbers in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
        if self.top_p is not None:
            _check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1] or None")
        if self.top_k is not None:
            top = MAX_COUNT if vocab is None else vocab
            _check(is_int(self.top_k) and 1 <= self.top_k <= top, "top_k", self.top_k, f"an int in [1, {top}] or None")
        if self.repetition_penalty is not None:
            _check(is_num(self.repetition_penalty) and MIN_PENALTY <= self.repetition_penalty <= MAX_PENALTY,
                   "repetition_penalty", self.repetition_penalty,
                   f"a number in [{MIN_PENALTY:g}, {MAX_PENALTY:g}] or None")
        _check(is_int(self.penalty_window) and 1 <= self.penalty_window <= MAX_PENALTY_WINDOW, "penalty_window",
               self.penalty_window, f"an int in [1, {MAX_PENALTY_WINDOW}]")
        _check(is_int(self.max_new_tokens) and 1 <= self.max_new_tokens <= MAX_COUNT, "max_new_tokens",
               self.max_new_tokens, f"an int in [1, {MAX_COUNT}]")
        _check(is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               self.min_new_tokens, f"an int in [0, max_new_tokens={self.max_new_tokens}]")
        if self.seed is not None:
            _check(is_int(self.seed) and 0 <= self.seed < 2**63, "seed", self.seed, "None or an int in [0, 2**63)")

    def temperatures(self, num_vq: int) -> tuple[float, ...]:
        """One temperature per output row: ``num_vq`` in code mode, 1 in text mode."""
        rows = 1 if self.mode is Mode.TEXT else num_vq
        return self.temperature if len(self.temperature) == rows else self.temperature * rows


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={short(value)} is invalid: must be {allowed}")
