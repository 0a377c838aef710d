"""A streamed response as a listener hears it: when each chunk came and how much audio it held, whether playback
started at the first chunk would stall, and the least start delay that never does. Light (numpy only), so the
bench's client processes import it without torch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..constants import SAMPLE_RATE

UNDERRUN_S = 1e-3
"""How late a chunk may come before playback stalls: the clock's and the hand-off's jitter, not a stall."""


@dataclass
class StreamRecord:
    """Wall-clock times (seconds from the stream's call) of one stream's chunks."""

    arrivals: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    end: float = 0.0

    def audio_s(self) -> float:
        return sum(self.samples) / SAMPLE_RATE

    def underrun(self) -> bool:
        """Playback from the first chunk on would wait for a later chunk."""
        return not self.arrivals or self.start_delay() > UNDERRUN_S

    def start_delay(self) -> float:
        """The smallest wait after the first chunk before playback that never stalls: how far the latest chunk
        is behind the audio ahead of it (seconds; inf without any chunk)."""
        if not self.arrivals:
            return float("inf")
        return max(0.0, float(np.max(self._behind())))

    def stall_chunk(self) -> int | None:
        """The chunk that playback started at the first one would first wait for (None: it never would)."""
        if not self.underrun() or not self.arrivals:
            return None
        return int(np.argmax(self._behind() > UNDERRUN_S))

    def _behind(self) -> np.ndarray:
        """Per chunk: how long after the audio ahead of it (played from the first chunk on) it arrived."""
        played = np.cumsum([0, *self.samples[:-1]]) / SAMPLE_RATE
        return np.array(self.arrivals) - self.arrivals[0] - played
