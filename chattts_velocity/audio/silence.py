"""What counts as silence in returned audio (shared by the reference and the velocity paths)."""

from __future__ import annotations

import numpy as np

SILENCE = np.float32(1e-5)
"""Samples at or below this magnitude are dropped from the returned audio, as upstream does."""


def audible(samples: np.ndarray) -> np.ndarray:
    """Where ``samples`` are above ``SILENCE``. NaN counts as audible: a broken decode must never pass for
    silence and vanish (``np.abs(nan) > x`` is False)."""
    return ~(np.abs(samples) <= SILENCE)
