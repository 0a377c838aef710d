"""Cutting input text into the pieces that are synthesised one by one."""

from __future__ import annotations

import re
from collections.abc import Callable

# Upstream ``Chat.infer`` cuts after a Chinese full stop or after ". " (so decimals such as 3.14 stay whole).
_SENTENCE_END = re.compile(r"(?<=。)|(?<=\.\s)")

# Break points for a piece too long for the model, strongest first: sentence ends, clause marks, whitespace.
# Each cut falls after the mark so the punctuation stays with the words it closes.
_BREAKS = (
    re.compile(r"(?<=[。！？!?])|(?<=\.)(?=\s)"),
    re.compile(r"(?<=[，,；;])"),
    re.compile(r"(?<=\s)"),
)


def split_text(text: str) -> list[str]:
    """Split like upstream ``Chat.infer(split_text=True)``: on newlines if any (empty lines kept), else after
    "。" and ". " (empty pieces dropped)."""
    if "\n" in text:
        return text.split("\n")
    return [piece for piece in _SENTENCE_END.split(text) if piece]


def split_long(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> list[str]:
    """Cut ``text`` into consecutive pieces of at most ``max_tokens`` tokens each, at the strongest break
    available, packing neighbouring parts back together greedily while they fit. ``"".join`` of the result
    is ``text``.

    Raises ``ValueError`` when a run with no break point is itself longer than ``max_tokens``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    return _split(text, count_tokens, max_tokens, level=0)


def _split(text: str, count_tokens: Callable[[str], int], max_tokens: int, level: int) -> list[str]:
    n_tokens = count_tokens(text)
    if n_tokens <= max_tokens:
        return [text]
    if level == len(_BREAKS):
        raise ValueError(
            f"text is longer than the model's context: {text[:40]!r}... has {n_tokens} tokens with no "
            f"punctuation or space to split it at, but at most {max_tokens} are allowed; "
            "add punctuation or shorten it"
        )
    parts = [part for part in _BREAKS[level].split(text) if part]
    pieces: list[str] = []
    for part in parts:
        for sub in _split(part, count_tokens, max_tokens, level + 1):
            # Counting the joined string (not summing counts) because tokenisation is not additive.
            if pieces and count_tokens(pieces[-1] + sub) <= max_tokens:
                pieces[-1] += sub
            else:
                pieces.append(sub)
    return pieces
