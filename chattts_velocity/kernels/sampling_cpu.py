"""``WindowSampler``: the CPU engine's sampler for a decode window, ``kernels.sampling``'s chain with what the
window does not change computed once, and on few candidates in numpy where the rows allow it."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..sampling.limits import MIN_TOKENS_TO_KEEP
from .sampling import ban_eos, cut_bounds, penalise, too_old, top_p_top_k
from .sampling_hash import row_hash, uniform_at, uniform_from_hash

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
    float rounding decides a near-tie. The candidates' way is several times faster than the whole-vocabulary
    chain, for peaked rows (the few largest) and flat ones (the partition) alike (docs/perf/)."""

    def __init__(self, temperature: Tensor, top_p: Tensor, top_k: Tensor, penalty: Tensor, window: Tensor,
                 min_new: Tensor, seed: Tensor, step: Tensor, lane: Tensor, eos_id: int, vocab: int, width: int,
                 num_steps: int):
        """Arguments as ``sample_rows_fused``'s (CPU tensors; ``step`` at the window's first step); ``width``:
        the history's."""
        self.temperature, self.penalty, self.eos_id = temperature, penalty, eos_id
        self.penalised = bool(penalty.ne(1).any())  # a penalty of 1 multiplies or divides by 1**n = 1 exactly
        self.too_old = too_old(torch.empty(0, width), window)
        self.drop_mass, self.top_k_drops = cut_bounds(vocab, top_p, top_k)
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
            logits = penalise(logits, history, self.too_old, self.penalty)
        logits = top_p_top_k(logits, self.drop_mass, self.top_k_drops)
        ban = self.bans[j]
        if all(ban):
            logits[:, self.eos_id] = -float("inf")
        elif any(ban):
            ban_eos(logits, torch.tensor(ban), self.eos_id)
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
        allows, 3, and this costs a few small ops, much less than the partition."""
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
