"""Logit processors in upstream ChatTTS order: temperature -> repetition penalty -> top-p -> top-k -> EOS mask.

Each is a pure function over a [N, V] float32 matrix (N = batch x codebooks in audio mode, batch in text mode),
so the reference loop and the engine's sampler share one definition of the maths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_TOKENS_TO_KEEP = 3
"""Upstream keeps at least three candidates through top-p and top-k."""
PENALTY_WINDOW = 16
"""Upstream penalises repeats among the last 16 generated tokens of each row."""

# Bounds on the settings, from what float32 logits can represent. Past them sampling is not sampling any more:
# below MIN_TEMPERATURE it is already greedy (an id trailing the best by 1e-3 gets exp(-100) of its mass,
# float32's subnormal range) and a smaller temperature only pushes logits / temperature towards inf and NaN
# (1e-50 is 0 in float32); above MAX_TEMPERATURE a trained head's logit gaps (tens at most) shrink below 0.3,
# so every id is about equally likely: noise. The penalty's alpha = penalty**count over a window of up to 64
# ids stays a normal float32 for penalty >= 0.5 (0.5**64 = 5e-20; 1e-30 underflows to 0, a positive logit
# divided by it is inf and the softmax NaN); at 10 one repeat already divides a logit tenfold, a ban in effect.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 100.0
MIN_PENALTY, MAX_PENALTY = 0.5, 10.0
MAX_COUNT = 2**31 - 1
"""Largest token count (``max_new_token``, ``top_k``) a setting may hold: the sampler's tensors hold it."""


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
