"""Text normalisation before tokenisation, string-for-string identical to upstream ``ChatTTS.norm.Normalizer``.

Upstream runs its character replacement through numba; a ``str.translate`` table does the same one-pass,
one-character-to-one-character mapping in C without the JIT warm-up.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from importlib import resources

# Anything the model cannot read: outside CJK ideographs, ASCII letters and a handful of punctuation marks.
_REJECT = re.compile(r"[^\u4e00-\u9fffA-Za-z，。、,\. ]")
# Control tags such as [uv_break] are legal whatever characters they contain.
_TAG = re.compile(r"\[[\w_]+\]")
_CHINESE_CHAR = re.compile(r"[\u4e00-\u9fff]")
_READABLE = re.compile(r"[\u4e00-\u9fffA-Za-z]")
_ENGLISH_WORD = re.compile(r"\b[A-Za-z]+\b")

# Applied only when the text has invalid characters: folds pauses into the commas / stops the model knows.
# "[" and "]" are left alone so that tags survive.
_SIMPLIFY = str.maketrans(
    {
        "：": "，", "；": "，", "！": "。", "（": "，", "）": "，", "【": "，", "】": "，", "『": "，", "』": "，",
        "「": "，", "」": "，", "《": "，", "》": "，", "－": "，",
        ":": ",", ";": ",", "!": ".", "(": ",", ")": ",", ">": ",", "<": ",", "-": ",",
    }
)  # fmt: skip

# Chinese text reads better with full-width punctuation; "[", "]" and "_" stay half-width for the tags.
_HALF_TO_FULL = str.maketrans(
    {
        "!": "！", '"': "“", "'": "‘", "#": "＃", "$": "＄", "%": "％", "&": "＆", "(": "（", ")": "）",
        ",": "，", "-": "－", "*": "＊", "+": "＋", ".": "。", "/": "／", ":": "：", ";": "；", "<": "＜",
        "=": "＝", ">": "＞", "?": "？", "@": "＠", "\\": "＼", "^": "＾", "`": "｀", "{": "｛", "|": "｜",
        "}": "｝", "~": "～",
    }
)  # fmt: skip

_PROBE = "test string 测试字符串"


def _split_tags(text: str) -> tuple[list[str], list[str]]:
    """Cut ``text`` into the plain runs and the ``[...]`` tags between them.

    Mirrors upstream's scanner quirk for quirk, because its output feeds back into the text: an unclosed tag is
    dropped, a ``[`` inside a tag restarts it, and a stray ``]`` stays in the run but also records an empty tag.
    """
    runs: list[str] = []
    tags: list[str] = []
    run: list[str] = []
    tag: list[str] = []  # non-empty exactly while inside a tag
    for ch in text:
        if ch == "[":
            runs.append("".join(run))
            run, tag = [], ["["]
        elif tag:
            tag.append(ch)
        else:
            run.append(ch)
        if ch == "]":
            tags.append("".join(tag))
            tag = []
    if run:
        runs.append("".join(run))
    return runs, tags


def _join_tags(runs: list[str], tags: list[str]) -> str:
    """Put each run back before its tag; like upstream, tags beyond the last run are lost."""
    return "".join(run + (tags[i] if i < len(tags) else "") for i, run in enumerate(runs))


def _map_between_tags(text: str, fn: Callable[[str], str]) -> str:
    runs, tags = _split_tags(text)
    return _join_tags([fn(run) for run in runs], tags)


def _load_homophones() -> dict[int, int]:
    path = resources.files("chattts_velocity").joinpath("res", "homophones_map.json")
    with path.open(encoding="utf-8") as f:
        pairs: dict[str, str] = json.load(f)
    return {ord(k): ord(v) for k, v in pairs.items()}


def is_speakable(text: str) -> bool:
    """Whether normalised ``text`` has anything to say: a Chinese character or a Latin letter outside the
    ``[...]`` tags (punctuation, spaces and tags alone are no speech)."""
    return _READABLE.search(_TAG.sub("", text)) is not None


class Normalizer:
    """Clean text for the model: optional per-language normalisers, punctuation folding, homophone fixes.

    The homophone map swaps characters ChatTTS tends to mispronounce for same-sounding ones it reads well.
    """

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(__name__)
        self.normalizers: dict[str, Callable[[str], str]] = {}
        self._homophones = _load_homophones()

    def __call__(
        self,
        text: str,
        do_text_normalization: bool = True,
        do_homophone_replacement: bool = True,
        lang: str | None = None,
    ) -> str:
        if do_text_normalization:
            lang = self.detect_language(text) if lang is None else lang
            if lang in self.normalizers:
                text = _map_between_tags(text, self.normalizers[lang])
            if lang == "zh":
                text = text.translate(_HALF_TO_FULL)
        invalid = set(_REJECT.findall(_TAG.sub("", text)))
        if invalid:
            text = text.translate(_SIMPLIFY)
        if do_homophone_replacement:
            text = self._replace_homophones(text)
        if invalid:
            dropped = sorted(set(_REJECT.findall(_TAG.sub("", text))))  # what no mapping turned into punctuation
            if dropped:
                self.logger.warning("dropped characters the model cannot read: %s", dropped)
            text = _map_between_tags(text, lambda run: _REJECT.sub("", run))
        return text

    def register(self, name: str, normalizer: Callable[[str], str]) -> bool:
        """Use ``normalizer`` on the text between tags of language ``name``; False if refused (see the log)."""
        if name in self.normalizers:
            self.logger.warning("normalizer %s is already registered", name)
            return False
        # Try it once so that a broken normaliser is refused here rather than failing every request.
        try:
            probe = normalizer(_PROBE)
        except Exception as e:
            self.logger.warning("normalizer %s failed on a test string: %s", name, e)
            return False
        if not isinstance(probe, str):
            self.logger.warning("normalizer %s must map str to str, returned %s", name, type(probe).__name__)
            return False
        self.normalizers[name] = normalizer
        return True

    def unregister(self, name: str) -> None:
        self.normalizers.pop(name, None)

    @staticmethod
    def detect_language(text: str) -> str:
        """"zh" when Chinese characters outnumber English words, else "en"."""
        return "zh" if len(_CHINESE_CHAR.findall(text)) > len(_ENGLISH_WORD.findall(text)) else "en"

    def _replace_homophones(self, text: str) -> str:
        out = text.translate(self._homophones)
        if out != text and self.logger.isEnabledFor(logging.DEBUG):
            swaps = ", ".join(f"{a}->{b}" for a, b in zip(text, out, strict=True) if a != b)
            self.logger.debug("replace homophones: %s", swaps)
        return out
