"""What the sampler can represent: the bounds every sampling setting is validated against (by
``SamplingParams`` and by upstream's ``InferCodeParams``/``RefineTextParams``), and the number checks both use.

Bounds on the settings come from what float32 logits can represent. Past them sampling is not sampling any
more: below MIN_TEMPERATURE it is already greedy (an id trailing the best by 1e-3 gets exp(-100) of its mass,
float32's subnormal range) and a smaller temperature only pushes logits / temperature towards inf and NaN
(1e-50 is 0 in float32); above MAX_TEMPERATURE a trained head's logit gaps (tens at most) shrink below 0.3, so
every id is about equally likely: noise. The penalty's alpha = penalty**count over a window of up to 64 ids
stays a normal float32 for penalty >= 0.5 (0.5**64 = 5e-20; 1e-30 underflows to 0, a positive logit divided by
it is inf and the softmax NaN); at 10 one repeat already divides a logit tenfold, a ban in effect.
"""

from __future__ import annotations

import numbers

MIN_TOKENS_TO_KEEP = 3
"""Upstream keeps at least three candidates through top-p and top-k."""
PENALTY_WINDOW = 16
"""Upstream penalises repeats among the last 16 generated tokens of each row."""
MAX_PENALTY_WINDOW = 64
"""Widest repetition-penalty window (the multi-step decoder keeps this many recent ids per row on the device)."""
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 100.0
MIN_PENALTY, MAX_PENALTY = 0.5, 10.0
MAX_COUNT = 2**31 - 1
"""Largest token count (``max_new_token``, ``top_k``) a setting may hold: the sampler's tensors hold it."""


# Every request's settings pass these checks on the thread that submits it; Python's own int and float are
# answered before the abstract-class checks, which cost several times more.
def is_int(x) -> bool:
    """An integer, Python or numpy (not a bool)."""
    kind = type(x)
    if kind is int or kind is float:
        return kind is int
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_num(x) -> bool:
    """A real number, Python or numpy (not a bool)."""
    kind = type(x)
    if kind is int or kind is float:
        return True
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def plain(x):
    """Numpy scalars (and lists of them) as Python numbers; anything else unchanged."""
    if x is None or type(x) is int or type(x) is float:
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    if is_int(x):
        return int(x)
    if is_num(x):
        return float(x)
    return x


def short(value) -> str:
    """``repr(value)``, cut to a readable length (a 400-digit int is reported by its size)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:12]}...({len(text)} characters)"
