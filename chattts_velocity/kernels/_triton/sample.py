"""Triton exponential race: one program per row hashes its uniforms and keeps the best ``p / E``.

``row_key``, ``race_score`` and ``first_argmax`` are the race's building blocks; the fused sampling kernel
(``sampling.py``) calls them too, so both kernels draw the same numbers as ``counter_uniform``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import sample

# Jitted code reads only constexpr globals; the values live in ``sample`` (the reference uses them too).
_MIX1 = tl.constexpr(sample.MIX1)
_MIX2 = tl.constexpr(sample.MIX2)
_COL_SALT = tl.constexpr(sample.COL_SALT)
_U_MAX = tl.constexpr(sample.U_MAX)


@triton.jit
def _mix32(x):
    """x: uint32 (products wrap modulo 2**32, as the reference's masked int64 arithmetic)."""
    x = x ^ (x >> 16)
    x = x * tl.full((), _MIX1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), _MIX2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def row_key(seed_ptr, step_ptr, lane_ptr, row):
    """The per-row half of the hash: uint32 scalar of (seed, step, lane) of ``row``."""
    seed = tl.load(seed_ptr + row)
    h = _mix32((seed >> 32).to(tl.uint32))
    h = _mix32(h ^ seed.to(tl.uint32))
    h = _mix32(h ^ tl.load(step_ptr + row).to(tl.uint32))
    return _mix32(h ^ tl.load(lane_ptr + row).to(tl.uint32))


@triton.jit
def race_score(p, cols, key):
    """p / E per id: E = -log U with U the counter uniform of (``key``, id). p, cols [BLOCK]."""
    bits = _mix32(key ^ _mix32(cols.to(tl.uint32) + tl.full((), _COL_SALT, tl.uint32)))
    u = tl.minimum(((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), _U_MAX)
    return p / -tl.log(u)


@triton.jit
def first_argmax(score, ids):
    """The id of the best score, the smallest id on ties (as torch.argmax). score, ids [BLOCK]."""
    top = tl.max(score, axis=0)
    return tl.min(tl.where(score == top, ids, 2147483647), axis=0)


@triton.jit
def _race_kernel(probs_ptr, seed_ptr, step_ptr, lane_ptr, out_ptr, stride, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = row_key(seed_ptr, step_ptr, lane_ptr, row)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < VOCAB
        p = tl.load(probs_ptr + row.to(tl.int64) * stride + cols, mask=valid, other=0.0)
        score = tl.where(valid, race_score(p, cols, key), -1.0)
        better = score > best  # strict: the earliest id wins ties, as torch.argmax
        best = tl.where(better, score, best)
        best_id = tl.where(better, cols, best_id)
    tl.store(out_ptr + row, first_argmax(best, best_id).to(tl.int64))


def exponential_race_triton(probs: Tensor, seed: Tensor, step: Tensor, lane: Tensor) -> Tensor:
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    block = min(triton.next_power_of_2(vocab), 1024 if probs.is_cuda else 128)
    _race_kernel[(rows,)](probs, seed, step, lane, out, probs.stride(0), VOCAB=vocab, BLOCK=block, num_warps=4)
    return out
