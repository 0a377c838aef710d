"""``RefineTextParams`` / ``InferCodeParams``: upstream ChatTTS's names and defaults, validated before any work."""

from __future__ import annotations

from dataclasses import dataclass


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

    def validate(self, num_vq: int = 4) -> None:
        """Raise ``ValueError`` naming the first out-of-range field and its allowed range."""
        if not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be a str, got {type(self.prompt).__name__}")
        temps = self.temperature if isinstance(self.temperature, (list, tuple)) else [self.temperature]
        if isinstance(self.temperature, (list, tuple)) and len(temps) != num_vq:
            raise ValueError(f"temperature list must have {num_vq} entries (one per codebook), got {len(temps)}")
        for t in temps:
            _check(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0,
                   "temperature", t, "a number > 0")
        if self.top_P is not None:
            _check(_is_num(self.top_P) and 0 < self.top_P <= 1, "top_P", self.top_P, "a number in (0, 1] or None")
        if self.top_K is not None:
            _check(_is_int(self.top_K) and self.top_K >= 1, "top_K", self.top_K, "an int >= 1 or None")
        if self.repetition_penalty is not None:
            _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
                   "repetition_penalty", self.repetition_penalty, "a number > 0 or None")
        _check(_is_int(self.max_new_token) and self.max_new_token >= 1, "max_new_token", self.max_new_token,
               "an int >= 1")
        _check(_is_int(self.min_new_token) and 0 <= self.min_new_token <= self.max_new_token,
               "min_new_token", self.min_new_token, f"an int in [0, max_new_token={self.max_new_token}]")
        if self.manual_seed is not None:
            _check(_is_int(self.manual_seed) and 0 <= self.manual_seed < 2**63, "manual_seed", self.manual_seed,
                   "None or an int in [0, 2**63)")

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

    def validate(self, num_vq: int = 4) -> None:
        super().validate(num_vq)
        _check(_is_int(self.stream_batch) and self.stream_batch >= 1, "stream_batch", self.stream_batch, "an int >= 1")
        _check(_is_int(self.stream_speed) and self.stream_speed >= 1, "stream_speed", self.stream_speed, "an int >= 1")
        _check(_is_int(self.pass_first_n_batches) and self.pass_first_n_batches >= 0, "pass_first_n_batches",
               self.pass_first_n_batches, "an int >= 0")
        for name in ("spk_smp", "txt_smp"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), name, type(value).__name__, "None or a str")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range: must be {allowed}")
