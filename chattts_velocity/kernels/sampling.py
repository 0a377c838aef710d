"""The whole sampling chain of a decode step, per row with its own parameters: temperature -> repetition
penalty over the newest ``window`` history ids -> top-p then top-k (each keeps at least MIN_TOKENS_TO_KEEP)
-> EOS banned while step < min_new -> softmax -> the seeded exponential race of ``sample.py``.

The torch chain is ~15 small kernels per step (sort, softmax, cumsum, scatter, gather, pow, ...); the Triton
kernel is one launch: a program per row holds the row in registers and takes both filters' thresholds from one
in-register sort. Ids equal the reference's up to float rounding on a near-tie (the kernel's exp, summation
order and repeated-multiply penalty power differ from torch's by an ulp).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from ..sampling.processors import MIN_TOKENS_TO_KEEP
from ._dispatch import check_contiguous, check_rows, check_same_device, check_tensor, use_triton
from .sample import exponential_race, exponential_race_ref, row_hash, uniform_at, uniform_from_hash

MAX_FUSED_VOCAB = 4096
"""Widest row the fused kernel holds in registers. Wider ones (the text head: 21178 ids, padded to 32768) run
the chain with the Triton race: fused, 64 such rows took 1.4 ms on an H100, the chain 0.34 ms."""


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
    logits = _penalise(logits, history, _too_old(history, window), penalty)
    logits = _top_p_top_k(logits, *_cut_bounds(logits.size(1), top_p, top_k))
    _ban_eos(logits, step < min_new, eos_id)
    return logits


def _too_old(history: Tensor, window: Tensor) -> Tensor:
    """[R, W] bool: the history entries older than each row's penalty window."""
    width = history.size(1)
    return torch.arange(width, device=history.device)[None, :] < width - window[:, None]


def _penalise(logits: Tensor, history: Tensor, too_old: Tensor, penalty: Tensor) -> Tensor:
    vocab = logits.size(1)
    slots = torch.where(too_old | (history < 0), vocab, history)  # empty or too old: a dropped extra column
    freq = torch.zeros(logits.size(0), vocab + 1, device=logits.device, dtype=torch.float32)
    freq.scatter_add_(1, slots, torch.ones_like(slots, dtype=torch.float32))
    alpha = torch.pow(penalty, freq[:, :vocab])
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def _cut_bounds(vocab: int, top_p: Tensor, top_k: Tensor) -> tuple[Tensor, Tensor]:
    """The per-row constants of ``_top_p_top_k``: the probability mass top-p may drop, [R, 1], and the
    number of smallest logits top-k drops, [R, 1] int64."""
    k = top_k.clamp(min=MIN_TOKENS_TO_KEEP, max=vocab)
    return 1 - top_p, (vocab - k)[:, None]


def _top_p_top_k(logits: Tensor, drop_mass: Tensor, top_k_drops: Tensor) -> Tensor:
    """Top-p then top-k (each keeps at least 3) as one threshold from an ascending sort of the values: top-p
    drops the prefix whose probabilities sum to at most ``drop_mass`` (1 - top_p), top-k the ``top_k_drops``
    smallest, so a logit survives iff it is >= the larger of the two cut values (ties at a cut all survive, as
    in the Triton kernel)."""
    vocab = logits.size(1)
    if logits.is_cuda:
        sorted_logits = torch.sort(logits).values
    else:  # numpy's sort: torch.sort took ~1 ms for 32 rows of 626 on a 2-core CPU, numpy ~0.08 ms
        sorted_logits = torch.from_numpy(np.sort(logits.numpy(), axis=1))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    dropped = (cum <= drop_mass).sum(dim=-1, keepdim=True).clamp(max=vocab - MIN_TOKENS_TO_KEEP)  # [R, 1]
    cut = sorted_logits.gather(1, torch.maximum(dropped, top_k_drops))  # [R, 1]
    return logits.masked_fill(logits < cut, -float("inf"))


def _ban_eos(logits: Tensor, ban: Tensor, eos_id: int) -> None:
    """EOS to -inf in the rows ``ban`` [R] bool marks, in place."""
    eos = logits[:, eos_id]
    logits[:, eos_id] = torch.where(ban, torch.full_like(eos, -float("inf")), eos)


MAX_CANDIDATES = 64
"""``WindowSampler`` draws among each row's ``top_k`` largest logits when no row keeps more than this many."""
_FEW = 4  # how many largest logits ``WindowSampler._few_largest`` takes one argmax at a time


class WindowSampler:
    """``sample_rows_fused_ref`` over the K steps of a CPU decode window, with what the window does not change
    computed once: the filters' per-row constants, each step's EOS ban, the race's row hashes. Rows keep their
    parameters for the window (their step counters advance by one a step); each call takes the step's history.

    When every row has a ``top_k`` of at most ``MAX_CANDIDATES`` (ChatTTS's default is 20), a step works on
    those candidates, in numpy, instead of the whole vocabulary in torch: the penalty touches only the
    history's ids; the candidates are the few largest logits taken one argmax at a time when that settles
    every row, else the C largest from a partition (no full sort); top-p reads the candidates' share of the
    whole row's probability (the mass above an id is what the ascending cumulative sum leaves); the race draws
    for the candidates alone. The result is the chain's: the same ids are kept (ties at the cut included; a
    tie at the C-th largest falls back to the chain) and the same race is run on them, so ids differ only where
    float rounding decides a near-tie. A step of 32 rows of 626 ids on a new array each call, 2-core CPU
    (`benchmarks/window_sampler.py`): the whole-vocabulary chain 0.59-0.61 ms, this way 0.15 ms for peaked rows
    (the few largest) and 0.31-0.32 ms for flat ones (the partition)."""

    def __init__(self, temperature: Tensor, top_p: Tensor, top_k: Tensor, penalty: Tensor, window: Tensor,
                 min_new: Tensor, seed: Tensor, step: Tensor, lane: Tensor, eos_id: int, vocab: int, width: int,
                 num_steps: int):
        """Arguments as ``sample_rows_fused``'s (CPU tensors; ``step`` at the window's first step); ``width``:
        the history's."""
        self.temperature, self.penalty, self.eos_id = temperature, penalty, eos_id
        self.penalised = bool(penalty.ne(1).any())  # a penalty of 1 multiplies or divides by 1**n = 1 exactly
        self.too_old = _too_old(torch.empty(0, width), window)
        self.drop_mass, self.top_k_drops = _cut_bounds(vocab, top_p, top_k)
        steps = step.numpy()[None, :] + np.arange(num_steps)[:, None]  # [K, R]
        self.bans = (torch.from_numpy(steps) < min_new).tolist()  # [K][R]
        self.hashes = row_hash(seed.numpy(), steps, lane.numpy())  # [K, R]
        self.vocab = vocab
        keep = vocab - self.top_k_drops  # [R, 1]: top-k's kept count (>= MIN_TOKENS_TO_KEEP)
        self.candidates = int(keep.max())
        self.fast = self.candidates <= MAX_CANDIDATES and self.candidates < vocab
        if self.fast:
            self.top_p = top_p.numpy()  # [R, 1]
            self.temperature_np = temperature.numpy()  # [R, 1]
            # penalty ** n for every count a window of the history can hold, by the chain's torch.pow
            self.powers = torch.pow(penalty, torch.arange(width + 1, dtype=torch.float32)).numpy()  # [R, W + 1]
            self.too_old_np = self.too_old.numpy()
            self.last_kept = keep[:, 0].numpy() - 1  # [R]: top-k's last kept rank
            self.row_index = np.arange(top_p.size(0))[:, None]  # [R, 1]
            self.row_starts = self.row_index * vocab

    def __call__(self, logits: Tensor, history: Tensor, j: int) -> Tensor:
        """Step ``j``: logits [R, V] float32, history [R, W] -> ids [R] int64."""
        return self._candidates(logits, history, j) if self.fast else self._chain(logits, history, j)

    def _chain(self, logits: Tensor, history: Tensor, j: int) -> Tensor:
        logits = logits / self.temperature
        if self.penalised:
            logits = _penalise(logits, history, self.too_old, self.penalty)
        logits = _top_p_top_k(logits, self.drop_mass, self.top_k_drops)
        ban = self.bans[j]
        if all(ban):
            logits[:, self.eos_id] = -float("inf")
        elif any(ban):
            _ban_eos(logits, torch.tensor(ban), self.eos_id)
        race = -torch.log(torch.from_numpy(uniform_from_hash(self.hashes[j], self.vocab)))  # Exp(1) per id
        return torch.argmax(torch.softmax(logits, dim=-1) / race, dim=-1)

    def _candidates(self, logits: Tensor, history: Tensor, j: int) -> Tensor:
        # in numpy: a small op there costs a fraction of a torch op's overhead
        rows, vocab = logits.shape
        spare = rows * vocab  # one element past the rows: where the penalty sends ids it does not count
        flat_x = np.empty(spare + 1, np.float32)
        x = flat_x[:spare].reshape(rows, vocab)
        np.divide(logits.numpy(), self.temperature_np, out=x)
        if self.penalised:
            hist = history.numpy()
            at = np.where(self.too_old_np | (hist < 0), spare, hist + self.row_starts)  # [R, W] into flat_x
            freq = np.bincount(at.ravel(), minlength=spare + 1)[at]  # how often each id occurs in its window
            alpha = self.powers[self.row_index, np.minimum(freq, self.powers.shape[1] - 1)]  # penalty ** freq
            flat_x[spare] = 0  # the uncounted ids' (its count is past the table's end: clipped)
            old = flat_x[at]
            flat_x[at] = np.where(old < 0, old * alpha, old / alpha)
        m = x.max(1, keepdims=True)
        mass = np.exp(x - m).sum(-1, keepdims=True)  # the whole row's, over exp(logit - max)
        # top-p: an id is kept while the mass above it is below top_p (the chain: while the ascending
        # cumulative sum up to it exceeds 1 - top_p); at least 3, at most top-k's count, ties at the cut kept
        settled = self._few_largest(x, m, mass)
        if settled is None:
            selected = self._c_largest(x)
            if selected is None:  # a tie at the C-th largest: more than C ids in a row
                return self._chain(logits, history, j)
            top, ids = selected
            ratio = np.exp(top - m)  # exp(logit - max) of the candidates
            settled = top, ids, ratio, self._last_kept(ratio / mass)
        top, ids, ratio, last = settled  # [R, C'] descending (C' > every row's kept count), and [R]
        rows_at = self.row_index
        kept = top >= top[rows_at[:, 0], last][:, None]
        ban = self.bans[j]
        if any(ban):  # EOS goes after the filters, as in the chain
            kept &= (ids != self.eos_id) | ~np.array(ban)[:, None]
        # the race on the kept ids: exp(top - max) / E, the chain's p / E up to the common 1 / sum
        race = -np.log(uniform_at(self.hashes[j], ids, self.vocab))
        score = np.where(kept, ratio / race, np.float32(-1))
        return torch.from_numpy(ids[rows_at[:, 0], score.argmax(-1)])

    def _last_kept(self, share: np.ndarray) -> np.ndarray:
        """[R] rank of each row's last kept id, from the candidates' shares of their row's mass [R, C']."""
        above = np.cumsum(share, -1) - share
        return np.minimum(np.maximum((above < self.top_p).sum(-1), MIN_TOKENS_TO_KEEP) - 1, self.last_kept)

    def _few_largest(self, x: np.ndarray, m: np.ndarray, mass: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """The FEW largest of each row, one argmax at a time, when they settle every row's kept ids (its kept
        count below FEW, and the next id strictly smaller than its cut): (values, ids, exp(value - max), last
        kept rank); None otherwise. A peaked row (low temperature: ChatTTS's 0.3) keeps the least top-p
        allows, 3, and this costs a few small ops where the partition took ~0.1 ms on a 2-core CPU."""
        rows_at, few = self.row_index[:, 0], min(_FEW, self.candidates + 1)
        work, top, ids = x.copy(), np.empty((x.shape[0], few), np.float32), np.empty((x.shape[0], few), np.int64)
        for r in range(few):
            i = work.argmax(1)
            ids[:, r], top[:, r] = i, work[rows_at, i]
            work[rows_at, i] = -np.inf
        ratio = np.exp(top - m)
        last = self._last_kept(ratio / mass)
        # settled: the kept ids end before the last column, which is smaller than the cut (no tie past it),
        # and top-p or top-k stopped them inside the columns, not the columns' end
        settled = (last < few - 1) & (top[rows_at, np.minimum(last + 1, few - 1)] < top[rows_at, last])
        return (top, ids, ratio, last) if settled.all() else None

    def _c_largest(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The C largest of each row (C: the largest top-k), descending: the C-th largest from a partition
        (torch.topk and a full sort took longer on a new row each step), the ids at or above it, sorted among
        themselves; None on a tie at the C-th largest."""
        rows, vocab = x.shape
        c, rows_at = self.candidates, self.row_index
        cut = np.partition(x, vocab - c, axis=1)[:, vocab - c, None]  # [R, 1]
        at = np.flatnonzero(x >= cut)
        if at.size != rows * c:
            return None
        ids = at.reshape(rows, c) - self.row_starts
        top = x[rows_at, ids]
        order = np.argsort(-top, axis=1, kind="stable")
        return top[rows_at, order], ids[rows_at, order]


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
