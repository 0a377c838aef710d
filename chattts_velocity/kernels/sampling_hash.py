"""The counter-based uniforms of seeded sampling: U = hash(seed, step, lane, id), a pure function of its
counters, so a row's draw depends on nothing else in the batch.

The hash constants live here, once: the numpy reference below and the Triton helpers
(``_triton/sampling.py``) both read them, so every path draws the same bits.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

MIX1, MIX2 = 0x7FEB352D, 0x846CA68B
"""The "lowbias32" integer finaliser's multipliers."""
COL_SALT = 0x9E3779B9
"""Added to an id before its half of the hash."""
U_MAX = 1.0 - 2.0**-24
"""The largest uniform: the top bucket, (2**24 - 0.5) / 2**24, rounds to 1.0 in float32, and U = 1 would give
E = 0, so p / E = NaN for a zero probability (which torch.argmax would pick) and -inf otherwise."""


def _mix32(x: np.ndarray) -> np.ndarray:
    """The finaliser on uint32 arrays: numpy's uint32 products wrap mod 2**32 like the kernel's."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(MIX1)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(MIX2)
    return x ^ (x >> np.uint32(16))


@functools.lru_cache(maxsize=8)
def _column_hash(vocab: int) -> np.ndarray:
    """The per-id half of the hash: the same for every row and step, so computed once per vocabulary."""
    return _mix32(np.arange(vocab, dtype=np.uint32) + np.uint32(COL_SALT))


def counter_uniform(seed: Tensor, step: Tensor, lane: Tensor, vocab: int) -> Tensor:
    """Uniform (0, 1) numbers [R, vocab] float32 on seed's device, a pure function of (seed, step, lane,
    column) per row. Computed with numpy on the host: a few dozen array ops instead of many small torch ops,
    which dominated the CPU engine's sampling step."""
    s, t, c = (x.detach().cpu().numpy() for x in (seed, step, lane))
    return torch.from_numpy(uniform_from_hash(row_hash(s, t, c), vocab)).to(seed.device)


def row_hash(seed: np.ndarray, step: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """The per-row half of the hash: int64 arrays (broadcast together) -> uint32."""
    h = _mix32((seed >> 32).astype(np.uint32))  # astype keeps the low 32 bits, like the kernel's casts
    h = _mix32(h ^ seed.astype(np.uint32))
    h = _mix32(h ^ step.astype(np.uint32))
    return _mix32(h ^ lane.astype(np.uint32))


def uniform_from_hash(h: np.ndarray, vocab: int) -> np.ndarray:
    """Row hashes [...] uint32 -> the uniforms [..., vocab] float32 of ``counter_uniform``."""
    return _uniform(_mix32(h[..., None] ^ _column_hash(vocab)))  # [..., V]


def uniform_at(h: np.ndarray, columns: np.ndarray, vocab: int) -> np.ndarray:
    """Row hashes [R] uint32, ids [R, C] -> the uniforms [R, C] of those ids only (``uniform_from_hash``'s
    values at ``columns``): a sampler that knows which ids can win draws for those alone."""
    return _uniform(_mix32(h[:, None] ^ _column_hash(vocab)[columns]))


def _uniform(bits: np.ndarray) -> np.ndarray:
    u = ((bits >> np.uint32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 24))
    return np.minimum(u, np.float32(U_MAX))
