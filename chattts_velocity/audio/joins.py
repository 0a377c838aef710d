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
