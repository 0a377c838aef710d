"""Durations the engine thread measures about itself, kept as cumulative histograms (Prometheus-style buckets)
so that a scrape, in this process or over the engine process's pipe, reads them whole."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds of the buckets, in seconds (a last one, +Inf, holds the rest)."""


@dataclass
class Timings:
    """How many durations fell at or under each of ``BUCKETS_S`` (not cumulative; ``counts[-1]``: above the
    last), their sum and their number."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    total_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.total_s += seconds
        self.count += 1

    def copy(self) -> Timings:
        return Timings(list(self.counts), self.total_s, self.count)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(upper bound, count at or under it)`` pairs, the last ``+Inf``: a histogram's buckets."""
        out, running = [], 0
        for bound, n in zip((*map(str, BUCKETS_S), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


THREAD_PARTS = ("idle", "step", "step_device_wait", "deliver", "deliver_device_wait")
"""Where the engine thread's time goes (``EngineStats.thread_time``): waiting for work; in the engine's step
(scheduling, launching, reading outputs) apart from ``step_device_wait``, its waits for the device; handing
the outputs over (the audio round, where it runs on the engine thread, and launching the next step ahead)
apart from ``deliver_device_wait``, likewise."""
