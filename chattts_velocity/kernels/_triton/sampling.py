"""Triton sampling: the seeded exponential race, and the whole chain of ``kernels.sampling`` fused into one
program per row held in registers.

``row_key``, ``race_score`` and ``first_argmax`` are the race's building blocks, shared by both kernels, so
each draws the same numbers as ``sampling_hash.counter_uniform``. The fused kernel pads the row to BLOCK (the
vocabulary's next power of two) with -inf. Top-p keeps the ascending-sorted suffix whose softmax mass exceeds
1 - top_p plus the last KEEP entries, and top-k the logits >= the k-th largest, so both are a threshold on the
logit: kept = logits >= max(top-p threshold, k-th largest), taken from one ``tl.sort`` of the row, as the
reference does from its sorted values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...sampling.limits import MIN_TOKENS_TO_KEEP
from .. import sampling_hash
from ._launch import num_warps_for

# Jitted code reads only constexpr globals; the values live in ``sampling_hash`` (the reference uses them too).
_MIX1 = tl.constexpr(sampling_hash.MIX1)
_MIX2 = tl.constexpr(sampling_hash.MIX2)
_COL_SALT = tl.constexpr(sampling_hash.COL_SALT)
_U_MAX = tl.constexpr(sampling_hash.U_MAX)


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


@triton.jit
def _sample_kernel(logits_ptr, temperature_ptr, top_p_ptr, top_k_ptr, penalty_ptr, history_ptr, window_ptr,
                   min_new_ptr, seed_ptr, step_ptr, lane_ptr, out_ptr, logits_stride, eos_id,
                   VOCAB: tl.constexpr, BLOCK: tl.constexpr, WIDTH: tl.constexpr, KEEP: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + cols, mask=cols < VOCAB, other=-float("inf"))
    x = tl.math.div_rn(x, tl.load(temperature_ptr + row))
    # repetition penalty: alpha = penalty ** (times the id is among the newest `window` history entries)
    penalty = tl.load(penalty_ptr + row)
    oldest = WIDTH - tl.load(window_ptr + row)
    alpha = tl.full([BLOCK], 1.0, tl.float32)
    for j in range(WIDTH):
        tok = tl.load(history_ptr + row.to(tl.int64) * WIDTH + j)  # -1 (empty) matches no column
        alpha = tl.where((cols == tok) & (j >= oldest), alpha * penalty, alpha)
    x = tl.where(x < 0, x * alpha, tl.math.div_rn(x, alpha))
    # top-p and top-k thresholds from the ascending sort (the -inf padding sorts first)
    s = tl.sort(x)
    e = tl.exp(s - tl.max(s, axis=0))
    cum = tl.cumsum(e / tl.sum(e, axis=0), axis=0)
    top_p_kept = (cum > 1.0 - tl.load(top_p_ptr + row)) | (cols >= BLOCK - KEEP)
    top_p_min = tl.min(tl.where(top_p_kept, s, float("inf")), axis=0)
    k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), KEEP), VOCAB)
    kth = tl.max(tl.where(cols == BLOCK - k, s, -float("inf")), axis=0)
    banned = (cols == eos_id) & (tl.load(step_ptr + row) < tl.load(min_new_ptr + row))
    x = tl.where((x >= tl.maximum(top_p_min, kth)) & ~banned, x, -float("inf"))
    # softmax numerators (the race's argmax ignores the common denominator), then the race
    p = tl.exp(x - tl.max(x, axis=0))
    score = race_score(p, cols, row_key(seed_ptr, step_ptr, lane_ptr, row))
    tl.store(out_ptr + row, first_argmax(score, cols).to(tl.int64))


def sample_rows_triton(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, penalty: Tensor,
                       history: Tensor, window: Tensor, min_new: Tensor, seed: Tensor, step: Tensor, lane: Tensor,
                       eos_id: int, num_warps: int | None = None) -> Tensor:
    """``num_warps`` overrides the default (for tuning)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(vocab)
    # twice the usual warps: the sort's stages are the cost (measured with `chattts-velocity bench`; docs/perf/)
    _sample_kernel[(rows,)](logits, temperature, top_p, top_k, penalty, history, window, min_new, seed, step, lane,
                            out, logits.stride(0), eos_id, VOCAB=vocab, BLOCK=block, WIDTH=history.size(1),
                            KEEP=MIN_TOKENS_TO_KEEP, num_warps=num_warps or num_warps_for(2 * block))
    return out
