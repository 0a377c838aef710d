"""OpenAI's ``/v1/audio/speech`` request schema (plus ChatTTS's extras) and its error body."""

from __future__ import annotations

import math
import re
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..model.tokenizer_files import PROMPT_TAGS
from ..sampling.limits import MIN_TEMPERATURE
from .audio_format import FORMATS

OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
MAX_MODEL_CHARS = 256
"""Longest ``model`` name: any model id is far shorter; the name is echoed in logs."""
MAX_INSTRUCTIONS_CHARS = 4096
"""Longest ``instructions``: as long as the longest input; they are parsed for refine tags and otherwise ignored."""

_CODE_PROMPT = re.compile("(?:" + "|".join(re.escape(tag) for tag in PROMPT_TAGS) + ")*")
"""What ``prompt`` may hold: the tokenizer's prompt tags only (``[speed_3][oral_2]``); a control token such as
``[spk_emb]`` or ``[Stts]`` would add a second speaker slot or end the prompt early."""

_CONTROL = re.compile(r"^(\[[a-z]+_\d+\])+$")
"""A ChatTTS refine prompt such as ``[oral_2][laugh_0][break_6]``."""


class SpeechRequest(BaseModel):
    """``POST /v1/audio/speech``. ``speed`` maps onto ChatTTS's ``[speed_N]`` prompt (N = 5 + 2.5·log2(speed),
    rounded, clipped to 0..9: 0.25 → 0, 0.5 → 2, 1 → 5, 2 → 8, 4 → 9). ``instructions`` made of ChatTTS refine
    tags (``[oral_2][laugh_0][break_6]``) become the refine prompt and turn refining on; other instructions are
    accepted and ignored (ChatTTS takes no free-text style prompt)."""

    model_config = ConfigDict(extra="forbid")

    # numbers and switches are strict (a bool is not a seed, "1" is not a speed); an int is still a float
    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    input: str
    voice: str | dict
    instructions: str | None = Field(default=None, max_length=MAX_INSTRUCTIONS_CHARS)
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = Field(
        default="mp3", description="flac is sent whole once generated (its header holds the length); the others "
                                   "stream as the audio is generated")
    speed: float = Field(default=1.0, ge=0.25, le=4.0, strict=True)
    stream_format: Literal["audio", "sse"] = "audio"
    # ChatTTS extras, bounded as the sampler is (``sampling.limits``), the temperature to at most 2
    seed: int | None = Field(default=None, ge=0, lt=2**63, strict=True)
    temperature: float = Field(default=0.3, ge=MIN_TEMPERATURE, le=2.0, strict=True)
    top_p: float = Field(default=0.7, gt=0.0, le=1.0, strict=True)
    top_k: int = Field(default=20, ge=1, le=626, strict=True)
    refine_text: bool = Field(default=False, strict=True)
    prompt: str | None = Field(default=None, max_length=64)
    """Extra ChatTTS code prompt tags, e.g. ``[speed_3]`` (overrides ``speed``)."""

    @field_validator("prompt")
    @classmethod
    def _prompt_tags(cls, prompt: str | None) -> str | None:
        if prompt is not None and not _CODE_PROMPT.fullmatch(prompt):
            raise ValueError("only ChatTTS prompt tags are allowed: [speed_0..9], [oral_0..9], [laugh_0..2], "
                             "[break_0..7], e.g. '[speed_3][oral_2]'")
        return prompt

    def speed_prompt(self) -> str:
        if self.prompt:
            return self.prompt
        level = min(9, max(0, round(5 + 2.5 * math.log2(self.speed))))
        return f"[speed_{level}]"

    @property
    def refines(self) -> bool:
        """The request runs ChatTTS's refine pass (``refine_text``, or refine tags as ``instructions``)."""
        return self.refine_text or self.refine_prompt() is not None

    def refine_prompt(self) -> str | None:
        """The refine prompt when the instructions are ChatTTS refine tags, else None."""
        text = (self.instructions or "").replace(" ", "")
        return text if _CONTROL.match(text) else None


assert set(FORMATS) == set(SpeechRequest.model_fields["response_format"].annotation.__args__)


def error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)
