"""``DemoConfig``: the web demo's limits, validated before the app is built."""

from __future__ import annotations

from dataclasses import dataclass

from chattts_velocity.server.settings import ServerConfig


@dataclass(frozen=True)
class DemoConfig:
    max_new_token: int = 2048
    """Most audio tokens per sentence (upstream's default)."""
    max_refine_token: int = 384
    """Most tokens of the refine pass per sentence (upstream's default)."""
    in_flight: int = 4
    """Sentences of one visitor's text generated at once (the rest follow as those finish)."""
    concurrency_limit: int | None = None
    """Visitors generating at once; default: the engine's ``max_num_seqs // in_flight`` (at least 1), so every
    running visitor's sentences fit in one engine batch."""
    max_queue: int | None = None
    """Generations waiting for a slot; beyond it a visitor gets Gradio's "queue is full" message. Default:
    4 x the concurrency limit."""
    max_sample_seconds: float = 60.0
    """Longest voice sample accepted for cloning."""
    max_input_chars: int = ServerConfig.max_input_chars
    """Longest text a visitor may generate, in characters: the speech server's limit."""

    def __post_init__(self) -> None:
        for name in ("max_new_token", "max_refine_token", "in_flight", "max_input_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("concurrency_limit", "max_queue"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be None (sized to the engine) or an int >= 1, got {value!r}")
        if not self.max_sample_seconds > 0.5:
            raise ValueError(f"max_sample_seconds must be > 0.5, got {self.max_sample_seconds!r}")

    def limits(self, max_num_seqs: int) -> tuple[int, int]:
        """(concurrency limit, queue size) for an engine that runs ``max_num_seqs`` sequences at once."""
        concurrency = self.concurrency_limit or max(1, max_num_seqs // self.in_flight)
        return concurrency, self.max_queue or 4 * concurrency
