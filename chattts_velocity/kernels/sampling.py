"""Sampling kernels' dispatch and torch references: the whole chain of a decode step, per row with its own
parameters: temperature -> repetition penalty over the newest ``window`` history ids -> top-p then top-k (each
keeps at least MIN_TOKENS_TO_KEEP) -> EOS banned while step < min_new -> softmax -> the seeded exponential race.

The race is categorical sampling as ``argmax(p / E)`` with ``E = -log U`` and U the counter uniform of
``sampling_hash`` (seed, step, lane, id), so a row's draw depends on nothing else in the batch.

The torch chain is many small kernels per step (sort, softmax, cumsum, scatter, gather, pow, ...); the Triton
kernel (``_triton/sampling.py``) is one launch: a program per row holds the row in registers and takes both
filters' thresholds from one in-register sort. Ids equal the reference's up to float rounding on a near-tie (the
kernel's exp, summation order and repeated-multiply penalty power differ from torch's by an ulp). The CPU
engine's decode windows sample through ``sampling_cpu.WindowSampler``, the same chain with per-window constants.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from ..sampling.limits import MIN_TOKENS_TO_KEEP
from ._dispatch import check, check_contiguous, check_rows, check_same_device, check_tensor, use_triton
from .sampling_hash import counter_uniform

MAX_FUSED_VOCAB = 4096
"""Widest row the fused kernel holds in registers. Wider ones (the text head, padded to 32768) run the chain
with the Triton race, which is faster there than one program holding the whole row (measured: docs/perf/)."""


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
    from ._triton.sampling import exponential_race_triton

    return exponential_race_triton(probs.contiguous(), seed, step, lane)


def sample_rows_fused(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, penalty: Tensor,
                      history: Tensor, window: Tensor, min_new: Tensor, seed: Tensor, step: Tensor, lane: Tensor,
                      eos_id: int) -> Tensor:
    """logits [R, V] float32 -> sampled ids [R] int64.

    temperature, top_p (1 = off), penalty (1 = off): [R, 1] float32. history [R, W] int64: generated ids,
    newest last, -1 = empty. top_k (>= V = off), window (newest history entries the penalty counts), min_new
    (EOS is banned while step < min_new), seed, step, lane: [R] int64. All on logits' device, contiguous.
    """
    args = (logits, temperature, top_p, top_k, penalty, history, window, min_new, seed, step, lane, eos_id)
    _check(*args)
    if not use_triton(logits):
        return sample_rows_fused_ref(*args)
    if logits.size(1) > MAX_FUSED_VOCAB:
        return _chain(*args, race=exponential_race)  # the torch chain, the Triton race
    from ._triton.sampling import sample_rows_triton

    return sample_rows_triton(*args)


def sample_rows_fused_ref(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, penalty: Tensor,
                          history: Tensor, window: Tensor, min_new: Tensor, seed: Tensor, step: Tensor,
                          lane: Tensor, eos_id: int) -> Tensor:
    """Torch reference of ``sample_rows_fused`` (the CPU path): the chain, softmax, the race."""
    return _chain(logits, temperature, top_p, top_k, penalty, history, window, min_new, seed, step, lane, eos_id,
                  race=exponential_race_ref)


def _chain(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, penalty: Tensor, history: Tensor,
           window: Tensor, min_new: Tensor, seed: Tensor, step: Tensor, lane: Tensor, eos_id: int,
           race: Callable[..., Tensor]) -> Tensor:
    filtered = process_rows(logits, temperature, top_p, top_k, penalty, history, window, min_new, step, eos_id)
    return race(torch.softmax(filtered, dim=-1), seed, step, lane)


def process_rows(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, penalty: Tensor,
                 history: Tensor, window: Tensor, min_new: Tensor, step: Tensor, eos_id: int) -> Tensor:
    """The ChatTTS chain on [R, V] float32 logits with per-row parameters (as ``sample_rows_fused``); returns
    the filtered logits [R, V], -inf where removed."""
    logits = logits / temperature
    logits = penalise(logits, history, too_old(history, window), penalty)
    logits = top_p_top_k(logits, *cut_bounds(logits.size(1), top_p, top_k))
    ban_eos(logits, step < min_new, eos_id)
    return logits


def too_old(history: Tensor, window: Tensor) -> Tensor:
    """[R, W] bool: the history entries older than each row's penalty window."""
    width = history.size(1)
    return torch.arange(width, device=history.device)[None, :] < width - window[:, None]


def penalise(logits: Tensor, history: Tensor, stale: Tensor, penalty: Tensor) -> Tensor:
    """The repetition penalty: alpha = penalty ** (times an id is in its row's history, ``stale`` [R, W] entries
    left out); negative logits x alpha, positive / alpha."""
    vocab = logits.size(1)
    slots = torch.where(stale | (history < 0), vocab, history)  # empty or too old: a dropped extra column
    freq = torch.zeros(logits.size(0), vocab + 1, device=logits.device, dtype=torch.float32)
    freq.scatter_add_(1, slots, torch.ones_like(slots, dtype=torch.float32))
    alpha = torch.pow(penalty, freq[:, :vocab])
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def cut_bounds(vocab: int, top_p: Tensor, top_k: Tensor) -> tuple[Tensor, Tensor]:
    """The per-row constants of ``top_p_top_k``: the probability mass top-p may drop, [R, 1], and the
    number of smallest logits top-k drops, [R, 1] int64."""
    k = top_k.clamp(min=MIN_TOKENS_TO_KEEP, max=vocab)
    return 1 - top_p, (vocab - k)[:, None]


def top_p_top_k(logits: Tensor, drop_mass: Tensor, top_k_drops: Tensor) -> Tensor:
    """Top-p then top-k (each keeps at least 3) as one threshold from an ascending sort of the values: top-p
    drops the prefix whose probabilities sum to at most ``drop_mass`` (1 - top_p), top-k the ``top_k_drops``
    smallest, so a logit survives iff it is >= the larger of the two cut values (ties at a cut all survive, as
    in the Triton kernel)."""
    vocab = logits.size(1)
    if logits.is_cuda:
        sorted_logits = torch.sort(logits).values
    else:  # numpy's sort: several times faster than torch.sort on a CPU at these sizes (docs/perf/)
        sorted_logits = torch.from_numpy(np.sort(logits.numpy(), axis=1))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    dropped = (cum <= drop_mass).sum(dim=-1, keepdim=True).clamp(max=vocab - MIN_TOKENS_TO_KEEP)  # [R, 1]
    cut = sorted_logits.gather(1, torch.maximum(dropped, top_k_drops))  # [R, 1]
    return logits.masked_fill(logits < cut, -float("inf"))


def ban_eos(logits: Tensor, ban: Tensor, eos_id: int) -> None:
    """EOS to -inf in the rows ``ban`` [R] bool marks, in place."""
    eos = logits[:, eos_id]
    logits[:, eos_id] = torch.where(ban, torch.full_like(eos, -float("inf")), eos)


def _check(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, penalty: Tensor, history: Tensor,
           window: Tensor, min_new: Tensor, seed: Tensor, step: Tensor, lane: Tensor, eos_id: int) -> None:
    check_tensor("logits", logits, "[R, V]", 2, (torch.float32,))
    check_rows("logits", logits)
    rows, vocab = logits.shape
    f32, i64 = torch.float32, torch.int64
    per_row = {"temperature": (temperature, "[R, 1]", f32), "top_p": (top_p, "[R, 1]", f32),
               "top_k": (top_k, "[R]", i64), "penalty": (penalty, "[R, 1]", f32), "history": (history, "[R, W]", i64),
               "window": (window, "[R]", i64), "min_new": (min_new, "[R]", i64), "seed": (seed, "[R]", i64),
               "step": (step, "[R]", i64), "lane": (lane, "[R]", i64)}
    for name, (t, shape, dtype) in per_row.items():
        check_tensor(name, t, shape, shape.count(",") + 1, (dtype,))
        if t.size(0) != rows or (shape == "[R, 1]" and t.size(1) != 1):
            raise ValueError(f"{name} must be {shape} with R = {rows} (logits' rows), got shape {tuple(t.shape)}")
        check_contiguous(name, t)
    check_same_device(logits=logits, **{name: spec[0] for name, spec in per_row.items()})
    if not (isinstance(eos_id, int) and 0 <= eos_id < vocab):
        raise ValueError(f"eos_id must be an int in [0, {vocab}), got {eos_id}")
