"""The texts ``Chat.infer`` synthesises: checked, split into sentences as upstream does, normalised, and cut
to fit the model's context."""

from __future__ import annotations

from collections.abc import Callable

from .normalizer import is_speakable
from .split import split_long, split_text

_UNREADABLE = ("has nothing the model can read after normalisation: ChatTTS reads Chinese characters and Latin "
               "letters (numbers only with a registered normaliser); emoji, control and zero-width characters "
               "and other scripts are dropped")


def model_texts(model, normalizer, text, split: bool, lang: str | None, do_norm: bool, do_homophone: bool) -> list[str]:
    """``prepare_texts`` for a model (its ``tokenizer`` and ``config``): each piece at most half its context."""
    return prepare_texts(text, split, lang, lambda t: normalizer(t, do_norm, do_homophone, lang), model.tokenizer.count,
                         model.config.max_position_embeddings // 2)


def prepare_texts(text, split: bool, lang: str | None, normalize: Callable[[str], str],
                  count_tokens: Callable[[str], int], max_tokens: int) -> list[str]:
    """``text`` (a str, or a list of str each synthesised on its own) as normalised texts; with ``split`` a str
    is cut into sentences (upstream's rule) and every text into pieces of at most ``max_tokens`` tokens.
    ``ValueError`` names a text that is empty or has nothing readable left after ``normalize``; a sentence of
    a split str with nothing readable is dropped instead (unless all are)."""
    if isinstance(text, str):
        if not text.strip():
            raise ValueError("text is empty: give at least one non-blank string")
        texts = [t for t in split_text(text) if t.strip()] if split else [text]
    elif isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text):
        blank = [i for i, t in enumerate(text) if not t.strip()]
        if blank:
            raise ValueError(f"text[{blank[0]}] is empty: every text must be a non-blank string")
        texts = list(text)
    else:
        raise ValueError("text must be a non-empty str or a non-empty list of str")
    if lang not in (None, "zh", "en"):
        raise ValueError(f"lang must be None, 'zh' or 'en', got {lang!r}")
    normalised = [normalize(t) for t in texts]
    if isinstance(text, str):
        normalised = [t for t in normalised if is_speakable(t)]
        if not normalised:
            raise ValueError(f"text {_clip(text)!r} {_UNREADABLE}")
    else:
        for i, t in enumerate(normalised):
            if not is_speakable(t):
                raise ValueError(f"text[{i}] {_clip(texts[i])!r} {_UNREADABLE}")
    if split:
        # a token covers at least one character (a WordPiece, [UNK] or a special token), so a text of at most
        # max_tokens characters is not counted: each count is a tokenizer call, which lets go of the GIL and
        # waits to take it back on a busy server (docs/perf/)
        normalised = [piece for t in normalised
                      for piece in (split_long(t, count_tokens, max_tokens) if len(t) > max_tokens else [t])]
    return normalised


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "..."
