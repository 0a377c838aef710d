"""``ServerConfig``: the speech server's settings, validated when built."""

from __future__ import annotations

import os
from dataclasses import dataclass

API_KEY_ENV = "CHATTTS_VELOCITY_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    """Limits, auth and storage of one ``chattts-velocity serve`` process."""

    max_concurrent: int = 64
    """Requests generating at once; more wait in the queue."""
    max_queue: int = 256
    """Requests waiting for a slot; beyond it the server answers 429 with ``Retry-After``."""
    max_input_chars: int = 4096
    """Longest ``input`` accepted (OpenAI's limit)."""
    api_key: str | None = None
    """Required as ``Authorization: Bearer <key>`` when set (default: the environment's
    ``CHATTTS_VELOCITY_API_KEY``, else no key)."""
    voices_dir: str | None = None
    """Where registered voices are kept across restarts; None: in memory only."""
    in_flight_sentences: int = 4
    """Sentences of one long input generated at once (the rest follow as those finish)."""
    max_new_token: int = 2048
    """Most audio tokens per sentence (ChatTTS's ``max_new_token``; 2048 tokens are 43.7 s)."""
    min_new_token: int = 0
    """Audio tokens per sentence before its end may be sampled (ChatTTS's ``min_new_token``; at most
    ``max_new_token``). For benchmarks: random weights sample the end early at random, and with
    ``min_new_token = max_new_token`` every request's audio has the same length."""
    retry_after_s: int = 1
    """``Retry-After`` of a 429."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish before the process exits."""
    keep_alive_s: int = 75
    """How long an idle client connection stays open. Longer than the clients' own pools keep one (httpx, under
    the ``openai`` SDK, reuses a connection idle up to 5 s): at uvicorn's default of 5 s a client could send a
    request down a connection the server was just closing, and see a read error before any byte."""
    audio_round_ms: float = 50.0
    """Least time between two audio decode rounds that hold only later chunks (``AudioPump.round_interval_s``):
    a request's first chunk is decoded at once, a later one up to this much later, and under load fewer,
    larger rounds leave the engine more of its time. 0: a round after every engine step."""
    model_name: str = "chattts-velocity"

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "max_input_chars", "in_flight_sentences", "max_new_token", "retry_after_s",
                     "keep_alive_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.min_new_token, int) or isinstance(self.min_new_token, bool) or self.min_new_token < 0:
            raise ValueError(f"min_new_token must be an int >= 0, got {self.min_new_token!r}")
        if self.min_new_token > self.max_new_token:
            raise ValueError(f"min_new_token ({self.min_new_token}) must be at most max_new_token ({self.max_new_token})")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {self.max_queue!r}")
        if not 0 <= self.audio_round_ms <= 1000:
            raise ValueError(f"audio_round_ms must be within 0-1000, got {self.audio_round_ms!r}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s!r}")
        if self.api_key is None and os.environ.get(API_KEY_ENV):
            object.__setattr__(self, "api_key", os.environ[API_KEY_ENV])
