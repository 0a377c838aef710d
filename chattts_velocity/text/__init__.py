"""Text side of ChatTTS: normalisation, splitting, tokenisation and speaker prompts."""

from __future__ import annotations

from .normalizer import Normalizer, is_speakable
from .prepare import model_texts, prepare_texts
from .speaker import (
    SpeakerStats,
    apply_speaker,
    decode_prompt,
    decode_speaker,
    decorate_code_prompts,
    decorate_text_prompts,
    encode_prompt,
    encode_speaker,
    speaker_vector,
)
from .split import split_long, split_text
from .tokenizer import Tokenizer, check_context

__all__ = [
    "Normalizer",
    "SpeakerStats",
    "Tokenizer",
    "apply_speaker",
    "check_context",
    "decode_prompt",
    "decode_speaker",
    "decorate_code_prompts",
    "decorate_text_prompts",
    "encode_prompt",
    "encode_speaker",
    "is_speakable",
    "model_texts",
    "prepare_texts",
    "speaker_vector",
    "split_long",
    "split_text",
]
