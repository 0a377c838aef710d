"""What the demo's Generate runs for one visitor, through the shared engine: the text pass (refine) and the
audio as int16 chunks, each step held by the visitor's ``Run`` so that Stop aborts exactly its requests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from chattts_velocity.chat import Chat
from chattts_velocity.params import InferCodeParams, RefineTextParams
from chattts_velocity.pipeline import JoinedAudio, refined_texts

from .session import Run


@dataclass(frozen=True)
class Settings:
    """One Generate's inputs, as the page gives them."""

    text: str
    refine: bool
    temperature: float
    top_p: float
    top_k: int
    speaker: str
    """Speaker string (``spk_emb``); blank for the model's default voice."""
    audio_seed: int
    text_seed: int
    sample_text: str
    """Transcript of the voice sample (``txt_smp``)."""
    sample_code: str
    """The voice sample's DVAE codes (``spk_smp``); with ``sample_text`` it replaces the speaker string."""

    @property
    def half_sample(self) -> bool:
        """Only one of the voice sample's code and its transcript was given: cloning needs both."""
        return bool(self.sample_text.strip()) != bool(self.sample_code.strip())

    def refine_params(self, max_new_token: int) -> RefineTextParams:
        # upstream's web UI refines with the same temperature / top_P / top_K sliders as the audio pass
        return RefineTextParams(temperature=self.temperature, top_P=self.top_p, top_K=self.top_k,
                                manual_seed=self.text_seed, max_new_token=max_new_token, show_tqdm=False)

    def code_params(self, max_new_token: int) -> InferCodeParams:
        cloned = bool(self.sample_text.strip() and self.sample_code.strip())
        return InferCodeParams(
            spk_emb=None if cloned or not self.speaker.strip() else self.speaker.strip(),
            spk_smp=self.sample_code.strip() if cloned else None, txt_smp=self.sample_text.strip() if cloned else None,
            temperature=self.temperature, top_P=self.top_p, top_K=self.top_k, manual_seed=self.audio_seed,
            max_new_token=max_new_token, show_tqdm=False,
        )


def prepare(chat: Chat, text: str) -> list[str]:
    """Normalised sentences of a visitor's text (``ValueError`` if it is blank)."""
    return chat.prepare_texts(text)


def refine(chat: Chat, texts: list[str], params: RefineTextParams, run: Run) -> list[str] | None:
    """Refined sentences (ids from ``[break_0]`` on dropped, as upstream), or None if the run was stopped."""
    params.validate(1)
    pipeline = chat.pipeline
    stream = pipeline.submit(pipeline.text_prompts(texts, params), pipeline.text_params(params))
    if not run.hold(stream.close):
        return None
    final = {out.request_id: out.token_ids for out in stream if out.finished}
    if run.cancelled or len(final) < len(texts):
        return None
    return refined_texts(chat.model.tokenizer, [final[rid] for rid in stream.request_ids])


def speak(chat: Chat, texts: list[str], params: InferCodeParams, run: Run, in_flight: int) -> Iterator[np.ndarray]:
    """The sentences' audio as one stream of int16 chunks (joins faded, no gaps), until it ends or the run is
    stopped. Every sentence is validated before the first chunk (``ValueError``)."""
    params.validate(chat.model.config.num_vq)
    return _int16(chat.pipeline.stream_joined(texts, params, use_decoder=True, in_flight=in_flight), run)


def _int16(audio: JoinedAudio, run: Run) -> Iterator[np.ndarray]:
    if not run.hold(audio.cancel):
        return
    try:
        for chunk in audio:
            yield to_int16(chunk)
    finally:
        audio.cancel()


def to_int16(wav: np.ndarray) -> np.ndarray:
    """Float audio in [-1, 1] to int16 at a fixed scale. Gradio normalises float chunks by each chunk's own
    peak, so streamed float chunks would change loudness from one chunk to the next."""
    return np.round(np.clip(wav, -1.0, 1.0) * 32767).astype(np.int16)
