"""Sample-level pieces of the streamed audio: joins between a request's sentences faded (no gap, no click), and
a batch's rows cut to the part every unfinished row has."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .pump import PENDING
from .silence import audible

FADE = 120
"""Samples (5 ms at 24 kHz) faded out at the end and in at the start of a joined text."""


def faded(chunks: Iterator[np.ndarray], first: bool, last: bool) -> Iterator[np.ndarray]:
    """``chunks`` faded in over their first ``FADE`` samples unless ``first``, and out over their last unless
    ``last`` (those are held back until the stream ends). ``PENDING`` passes through."""
    ramp = np.linspace(0.0, 1.0, FADE, dtype=np.float32)
    hold = 0 if last else FADE
    pending, fading_in = np.zeros(0, dtype=np.float32), not first
    for chunk in chunks:
        if chunk is PENDING:
            yield chunk
            continue
        pending = np.concatenate([pending, chunk])
        if fading_in:
            if pending.size < FADE:
                continue
            pending[:FADE] *= ramp
            fading_in = False
        if pending.size > hold:
            yield pending[: pending.size - hold]
            pending = pending[pending.size - hold :]
    n = pending.size
    if fading_in:
        pending = pending * ramp[:n]
    if not last:
        pending = pending * ramp[::-1][FADE - n :]
    if n:
        yield pending


class Joiner:
    """``faded`` over consecutive sentences fed one chunk at a time, when whether a sentence is the last is
    learned only after its audio (a realtime context's text is still arriving): the last ``FADE`` samples of
    each sentence are held back until ``next_sentence`` (faded out) or ``finish`` (as they are). The output,
    concatenated, equals ``faded`` over each sentence's chunks with ``first`` and ``last`` as they turned out."""

    def __init__(self):
        self._ramp = np.linspace(0.0, 1.0, FADE, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._fading_in = False

    @property
    def held(self) -> int:
        """Samples pushed and not yet returned."""
        return self._pending.size

    def push(self, samples: np.ndarray) -> np.ndarray:
        """The current sentence's next samples in; what may be sent now out (maybe empty)."""
        pending = np.concatenate([self._pending, samples])
        if self._fading_in:
            if pending.size < FADE:
                self._pending = pending
                return pending[:0]
            pending[:FADE] *= self._ramp
            self._fading_in = False
        cut = max(pending.size - FADE, 0)
        self._pending = pending[cut:]
        return pending[:cut]

    def next_sentence(self) -> np.ndarray:
        """The current sentence was not the last: its held tail, faded out. The next ``push`` starts the next
        sentence (faded in)."""
        tail = self._tail()
        tail = tail * self._ramp[::-1][FADE - tail.size :]
        self._fading_in = True
        return tail

    def finish(self) -> np.ndarray:
        """The current sentence was the last: its held tail."""
        return self._tail()

    def _tail(self) -> np.ndarray:
        tail, self._pending = self._pending, np.zeros(0, dtype=np.float32)
        if self._fading_in:  # a sentence shorter than the fade-in
            tail = tail * self._ramp[: tail.size]
            self._fading_in = False
        return tail


def aligned(rows: dict[str, list[np.ndarray]], done: frozenset[str], order) -> np.ndarray | None:
    """Take the samples every unfinished row has ([B, n]; finished rows, those in ``done``, padded with zeros),
    minus the columns that are silent in every row; None if there is nothing to yield yet."""
    for rid in order:
        if len(rows[rid]) > 1:
            rows[rid] = [np.concatenate(rows[rid])]
    have = {rid: rows[rid][0].size if rows[rid] else 0 for rid in order}
    live = [have[rid] for rid in order if rid not in done]
    n = min(live) if live else max(have.values())
    if n == 0:
        return None
    chunk = np.zeros((len(order), n), dtype=np.float32)
    for i, rid in enumerate(order):
        if rows[rid]:
            row = rows[rid][0]
            chunk[i, : min(n, row.size)] = row[:n]
            rows[rid] = [row[n:]] if row.size > n else []
    chunk = chunk[:, audible(chunk).any(axis=0)]
    return chunk if chunk.shape[1] else None
