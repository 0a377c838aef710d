"""When each listener of a stream runs out of audio, and how soon the ``AudioPump`` can bring it more.

A listener starts playback at a request's first audio and plays on at real time, so it runs dry at that moment
plus the seconds of audio sent since: the request's deadline. The pump brings audio only in its rounds, one
after each engine step, so after a round's deliveries the next can come one step and one full round later: the
gap. ``Pace`` estimates it from the recent steps and rounds, with a full round's cost growing with the feeds it
serves (a burst of new streams makes the next rounds longer than any seen yet)."""

from __future__ import annotations

from collections import deque

from ..constants import SAMPLE_RATE, SAMPLES_PER_TOKEN

TOKEN_S = SAMPLES_PER_TOKEN / SAMPLE_RATE
"""Seconds of audio per GPT token."""

PLAYBACK_GUARD_S = 0.03
"""How much longer than the estimated gap a listener's audio must last: the estimate is built from the last
few steps and rounds, and the next can be longer still (many prompts prefilled at once, a garbage collection);
the pump's hand-off to the reader comes on top."""

RECENT = 16
"""Steps and rounds the estimates look back over: enough to span a paced round's interval at a light load's
steps, few enough to forget a burst soon after it ends."""

BURST = 8
"""Requests reaching their first audio in one round that make a burst (see ``safe_to_start``)."""

BURST_FACTOR = 2.0
"""How many estimated gaps the first audio of a burst must outlast. A burst's first audio is followed by its
first full decode window, at a batch no recent step has run (the recent steps were its prefills and its short
first windows), and by a round that decodes each new stream's next two chunks: both take longer than anything
the estimate was made of (`python benchmarks/stream_underruns.py`; docs/perf/). A lone new request joins steps
and rounds like the recent ones."""

BURST_CHUNKS = 2
"""Chunks the first audio of a burst holds at the least where no round since the pump began served a load like
it (``Pace.knows``): its estimate is then made of smaller steps and rounds (the burst's prefills and short first
windows, rounds of a few feeds scaled up), and the burst's first full window and round took several times as
long as estimated, after one chunk had played (256 streams started together on a fresh engine: `chattts-velocity
bench stream --streams 256`; docs/perf/stream.md). Once a full round has served such a load the rule is off for
that load: the recent rounds then carried its cost, and the later bursts of that run stalled none."""

SCALE_FROM = 8
"""Fewest feeds of a round whose cost is scaled to more feeds: a round of a few feeds costs mostly its fixed part
(a call per window length), and scaled up, its noise would dominate the estimate."""


class Pace:
    """The recent engine steps (from the end of one wake of the pump to the next wake) and full rounds (their
    duration and the feeds they served), on the pump's clock."""

    def __init__(self) -> None:
        self._steps: deque[float] = deque(maxlen=RECENT)
        self._rounds: deque[tuple[float, int]] = deque(maxlen=RECENT)
        self._widest = 0  # the most feeds open at a full round since the pump began
        self._rested: float | None = None

    def woke(self, now: float) -> None:
        """A wake begins: the engine's step since the last wake ended counts (unless ``rested(None)`` came)."""
        if self._rested is not None:
            self._steps.append(now - self._rested)

    def rested(self, now: float | None) -> None:
        """A wake ended at ``now``; None: no feed is open, so the time until the next wake is no busy step."""
        self._rested = now

    def round_took(self, seconds: float, feeds: int, open_feeds: int) -> None:
        """A full round served ``feeds`` feeds (with windows) in ``seconds``, of ``open_feeds`` open (the load)."""
        self._rounds.append((seconds, feeds))
        self._widest = max(self._widest, open_feeds)

    def round_s(self, feeds: int) -> float:
        """A full round's expected cost for ``feeds`` feeds: the most of the recent rounds, each of at least
        ``SCALE_FROM`` feeds scaled to that many (its cost beyond the cheapest round's, the fixed part, in
        proportion to the feeds)."""
        if not self._rounds:
            return 0.0
        fixed = min(seconds for seconds, _ in self._rounds)
        return max(fixed + (seconds - fixed) * feeds / n if n >= SCALE_FROM else seconds
                   for seconds, n in self._rounds)

    def knows(self, feeds: int) -> bool:
        """Whether a full round since the pump began served a load of at least half as many feeds (see
        ``BURST_CHUNKS``)."""
        return 2 * self._widest >= feeds

    def gap_s(self, feeds: int) -> float:
        """How long after one round's deliveries the next round's may come: the longest recent step, then a full
        round of ``feeds`` feeds."""
        return max(self._steps, default=0.0) + self.round_s(feeds)


def deadline(started: float | None, emitted_tokens: int) -> float | None:
    """When a listener that started playback at ``started`` runs dry, having received ``emitted_tokens`` tokens
    of audio (None before the first audio)."""
    return None if started is None else started + emitted_tokens * TOKEN_S


def safe_to_start(ready_tokens: int, gap_s: float, starting: int, least_tokens: int = 0) -> bool:
    """Whether a request's first audio, ``ready_tokens`` tokens decodable now, lasts until the next round can
    bring more (``Pace.gap_s``, ``BURST_FACTOR`` times it when ``starting`` requests reach their first audio in
    this round make a burst, plus the guard), and, in a burst, holds at least ``least_tokens`` (its first
    ``BURST_CHUNKS`` chunks where the pace does not know the load, else 0). On an engine far faster than real
    time the first chunk passes at once; on a loaded one the first audio comes a step or more later, with as
    much audio as the wait for the next chunk needs."""
    burst = starting >= BURST
    if burst and ready_tokens < least_tokens:
        return False
    return ready_tokens * TOKEN_S >= (BURST_FACTOR if burst else 1.0) * gap_s + PLAYBACK_GUARD_S
