"""Cutting input text into the pieces that are synthesised one by one."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

# Upstream ``Chat.infer`` cuts after a Chinese full stop or after ". " (so decimals such as 3.14 stay whole).
_SENTENCE_END = re.compile(r"(?<=。)|(?<=\.\s)")
# The same ends seen one at a time in a growing text, and a newline (an end of its own there).
_PIECE_END = re.compile(r"。|\.\s|\n")

# Break points for a piece too long for the model, strongest first: sentence ends, clause marks, commas,
# whitespace. Each cut falls after the mark so the punctuation stays with the words it closes. Below them all,
# any character boundary (a ``[...]`` control tag counts as one character).
_BREAKS = (
    re.compile(r"(?<=[。！？!?])|(?<=\.)(?=\s)"),
    re.compile(r"(?<=[；;：:])"),
    re.compile(r"(?<=[，,、])"),
    re.compile(r"(?<=\s)"),
)
_CHARACTER = re.compile(r"\[[\w_]+\]|.", re.DOTALL)
_END = len(_BREAKS) + 1
"""Strength of the end of the text (stronger than any break)."""


def split_text(text: str) -> list[str]:
    """Split like upstream ``Chat.infer(split_text=True)``: on newlines if any (empty lines kept), else after
    "。" and ". " (empty pieces dropped)."""
    if "\n" in text:
        return text.split("\n")
    return [piece for piece in _SENTENCE_END.split(text) if piece]


class SentenceBuffer:
    """``split_text`` applied to text that arrives in pieces (a realtime context's appends): each sentence is
    handed out as soon as its end is seen. For text without newlines the pieces are ``split_text``'s (blank ones
    left out); a newline also ends a piece and is dropped, whether or not the text had one before."""

    def __init__(self):
        self._text = ""
        self._seen = 0  # the text before this holds no end (a "." at its end may yet become one)

    @property
    def pending(self) -> int:
        """Characters buffered: not yet handed out as a piece."""
        return len(self._text)

    def append(self, text: str) -> list[str]:
        """Add ``text``; the pieces now complete, in order (none blank)."""
        self._text += text
        pieces = []
        while match := _PIECE_END.search(self._text, self._seen):
            newline = match.group().endswith("\n")
            end = match.end()
            piece, self._text, self._seen = self._text[: end - 1 if newline else end], self._text[end:], 0
            if piece.strip():
                pieces.append(piece)
        self._seen = max(0, len(self._text) - 1)
        return pieces

    def flush(self) -> list[str]:
        """What is buffered, as the last piece (none if it is blank); the buffer is then empty."""
        piece, self._text, self._seen = self._text, "", 0
        return [piece] if piece.strip() else []


def split_long(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> list[str]:
    """Cut ``text`` into consecutive pieces of at most ``max_tokens`` tokens each. Each cut falls at the strongest
    boundary available (sentence end, clause mark, comma, space, else any character) among those that leave the
    piece at least half full, the latest of equals, so pieces are few and end where the text pauses.
    ``"".join`` of the result is ``text``.

    Linear in the text's length: every part is counted once per break level it is cut at, and each piece once
    more to check it (token counts are not always additive, e.g. where a cut splits a word; a piece that came
    out too long is cut again)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    n = count_tokens(text)
    if n <= max_tokens:
        return [text]
    segments = list(_segments(text, n, count_tokens, max_tokens, 0, _END))
    return [piece for span in _pack(segments, max_tokens) for piece in _fit(segments, span, count_tokens, max_tokens)]


Segment = tuple[str, int, int]
"""(text, tokens, strength of the boundary after it)."""


def _segments(text: str, n: int, count_tokens, max_tokens: int, level: int, end: int) -> Iterator[Segment]:
    """``text`` (``n`` > ``max_tokens`` tokens) cut at break ``level`` (and finer, where a part is still too
    long) into parts of at most ``max_tokens`` tokens; ``end`` is the strength of the boundary after it."""
    if level == len(_BREAKS):
        yield from _characters(text, count_tokens, max_tokens, end)
        return
    parts = [part for part in _BREAKS[level].split(text) if part]
    if len(parts) == 1:  # no such break: the next level, without counting the same text again
        yield from _segments(text, n, count_tokens, max_tokens, level + 1, end)
        return
    strength = len(_BREAKS) - level
    for i, part in enumerate(parts):
        after = end if i == len(parts) - 1 else strength
        part_n = count_tokens(part)
        if part_n <= max_tokens:
            yield part, part_n, after
        else:
            yield from _segments(part, part_n, count_tokens, max_tokens, level + 1, after)


def _characters(text: str, count_tokens, max_tokens: int, end: int) -> Iterator[Segment]:
    """A run with no break point, in runs of ``max_tokens`` characters (halved while one holds too many
    tokens; a character is one token or none for the ChatTTS tokenizer)."""
    chars = _CHARACTER.findall(text)
    size = max_tokens
    i = 0
    while i < len(chars):
        chunk = "".join(chars[i : i + size])
        n = count_tokens(chunk)
        if n > max_tokens and size > 1:
            size //= 2
            continue
        i += size
        yield chunk, n, end if i >= len(chars) else 0
        size = max_tokens


def _pack(segments: list[Segment], max_tokens: int) -> Iterator[range]:
    """Consecutive spans of ``segments`` whose token counts add up to at most ``max_tokens``, each ending at
    the best boundary (see ``split_long``)."""
    start, total = 0, 0
    for i, (_, n, _) in enumerate(segments):
        while total + n > max_tokens and i > start:
            cut = _best_cut(segments, start, i, max_tokens)
            yield range(start, cut)
            total -= sum(segments[j][1] for j in range(start, cut))
            start = cut
        total += n
    yield range(start, len(segments))


def _best_cut(segments: list[Segment], start: int, stop: int, max_tokens: int) -> int:
    """Where to end the piece ``segments[start:stop]`` (an index in ``(start, stop]``): the strongest boundary
    that leaves the piece at least half full (any, if none does), the latest of equals."""
    best, best_key, total = stop, None, 0
    for j in range(start, stop):
        total += segments[j][1]
        key = (2 * total >= max_tokens, segments[j][2], j)
        if best_key is None or key > best_key:
            best, best_key = j + 1, key
    return best


def _fit(segments: list[Segment], span: range, count_tokens, max_tokens: int) -> list[str]:
    """The text of ``span`` as one piece, or cut again where the joined text holds more tokens than its parts."""
    text = "".join(segments[j][0] for j in span)
    if len(span) == 1 or count_tokens(text) <= max_tokens:
        return [text]
    cut = _best_cut(segments, span.start, span.stop - 1, max_tokens)
    return (_fit(segments, range(span.start, cut), count_tokens, max_tokens)
            + _fit(segments, range(cut, span.stop), count_tokens, max_tokens))
