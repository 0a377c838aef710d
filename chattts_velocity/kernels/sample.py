"""Seeded categorical sampling as an exponential race: ``argmax(p / E)`` with ``E = -log U`` and U a
counter-based hash of (seed, step, lane, id), so a row's draw depends on nothing else in the batch.

The torch reference builds the [R, V] uniforms with ~50 elementwise ops; the Triton kernel does the whole race
in one launch per step (measured at batch 1 on an H100 inside the decode CUDA graph: see the README).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._dispatch import check, check_tensor, use_triton

_M32 = 0xFFFFFFFF
MIX1, MIX2 = 0x7FEB352D, 0x846CA68B
"""The "lowbias32" integer finaliser's multipliers."""
COL_SALT = 0x9E3779B9


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for uint32 values held in int64, without overflowing int64."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX2)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=8)
def _column_hash(vocab: int, device: torch.device) -> Tensor:
    """The per-id half of the hash: the same for every row and step, so computed once per vocabulary."""
    return _mix32(torch.arange(vocab, device=device, dtype=torch.int64) + COL_SALT)


def counter_uniform(seed: Tensor, step: Tensor, lane: Tensor, vocab: int) -> Tensor:
    """Uniform (0, 1) numbers [R, vocab] float32, a pure function of (seed, step, lane, column) per row."""
    h = _mix32((seed >> 32) & _M32)
    h = _mix32(h ^ (seed & _M32))
    h = _mix32(h ^ (step & _M32))
    h = _mix32(h ^ (lane & _M32))  # [R]
    cols = _column_hash(vocab, seed.device)  # [V]
    bits = _mix32(h[:, None] ^ cols[None, :])  # [R, V]
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def exponential_race_ref(probs: Tensor, seed: Tensor, step: Tensor, lane: Tensor) -> Tensor:
    race = -torch.log(counter_uniform(seed, step, lane, probs.size(1)))  # Exp(1) per (row, id)
    return torch.argmax(probs / race, dim=-1)


def exponential_race(probs: Tensor, seed: Tensor, step: Tensor, lane: Tensor) -> Tensor:
    """probs [R, V] float32 (rows sum to 1; zeros never win); seed/step/lane [R] int64 -> ids [R] int64."""
    check_tensor("probs", probs, "[R, V]", 2, (torch.float32,))
    for name, t in (("seed", seed), ("step", step), ("lane", lane)):
        check_tensor(name, t, "[R]", 1, (torch.int64,))
        check(t.size(0) == probs.size(0), f"{name} has {t.size(0)} rows, probs {probs.size(0)}")
    if not use_triton(probs):
        return exponential_race_ref(probs, seed, step, lane)
    from ._triton.sample import exponential_race_triton

    return exponential_race_triton(probs.contiguous(), seed, step, lane)
