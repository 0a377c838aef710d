"""Upstream ChatTTS's logit processors, in its order: temperature -> repetition penalty -> top-p -> top-k -> EOS
mask. The reference decode (``reference.py``) samples through them, and the engine's chain
(``kernels.sampling``) is tested against them row by row.

Each is a pure function over a [N, V] float32 matrix (N = batch x codebooks in audio mode, batch in text mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .limits import MIN_TOKENS_TO_KEEP, PENALTY_WINDOW


def repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, penalty: float, row_cap: int | None = None
) -> torch.Tensor:
    """Scale logits of ids seen in the last ``PENALTY_WINDOW`` tokens: alpha = penalty**count,
    negative logits x alpha, positive / alpha.

    logits [N, V]; history [N, L] generated ids (L may be 0). ``row_cap`` reproduces upstream's cap that
    zeroes the counts of rows >= cap (it meant ids but compares rows); the engine passes None.
    """
    if history.size(1) > PENALTY_WINDOW:
        history = history[:, -PENALTY_WINDOW:]
    freq = F.one_hot(history, logits.size(1)).sum(1)  # [N, V]
    if row_cap is not None and freq.size(0) > row_cap:
        freq[row_cap:] = 0
    alpha = torch.pow(penalty, freq)
    return torch.where(logits < 0, logits * alpha, logits / alpha)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable ids whose mass reaches ``top_p`` (at least 3)."""
    sorted_logits, order = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1 - top_p)
    drop_sorted[..., -MIN_TOKENS_TO_KEEP:] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, -float("inf"))


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits (at least 3; ties with the k-th are kept)."""
    k = min(max(top_k, MIN_TOKENS_TO_KEEP), logits.size(-1))
    kth = torch.topk(logits, k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, -float("inf"))


def process_logits(
    logits: torch.Tensor,
    history: torch.Tensor,
    temperature: torch.Tensor,
    top_p: float | None,
    top_k: int | None,
    penalty: float | None,
    ban_eos: bool,
    eos_id: int,
    row_cap: int | None = None,
) -> torch.Tensor:
    """The whole upstream chain; returns filtered logits [N, V]. temperature [N, 1]."""
    logits = logits / temperature
    if penalty is not None and penalty != 1:
        logits = repetition_penalty(logits, history, penalty, row_cap)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if ban_eos:
        logits[:, eos_id] = -float("inf")
    return logits
