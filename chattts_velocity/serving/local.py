"""``LocalClient``: the engine seam over a ``Chat`` loaded in this process (one-process serving, a Ray replica,
the web demo, ``synth``, and the engine process's own side)."""

from __future__ import annotations

import asyncio

import numpy as np

from ..engine import EngineStats, Prompt, SamplingParams
from ..engine.async_engine import STALL_S
from ..params import RefineTextParams
from ..pipeline import JoinedAudio, refined_texts
from .client import EngineClient, EngineInfo
from .kit import SpeechKit
from .voices import SharedVoices, Voice, VoiceRegistry


class LocalClient(EngineClient):
    """Requests run in ``chat``'s engine, their audio read straight from its pipeline (``JoinedAudio``)."""

    def __init__(self, chat, voices_dir: str | None = None, shared_voices: SharedVoices | None = None,
                 owns_chat: bool = False, stall_s: float = STALL_S):
        """``voices_dir``: where registered voices are kept (``VoiceRegistry``'s folder); ``shared_voices``: a
        store other replicas read; ``owns_chat``: ``close`` unloads ``chat``; ``stall_s``: ``health`` fails once
        the engine has had work this long without finishing a step."""
        self.chat = chat
        self.owns_chat, self.stall_s = owns_chat, stall_s
        self.kit = SpeechKit.of(chat)
        self.info = EngineInfo(str(chat.device), chat.engine.config.max_num_seqs)
        self.voices = VoiceRegistry(self.kit.speaker_stats, self.kit.config.hidden_size, voices_dir, shared_voices,
                                    encode=chat.sample_audio_speaker)

    def start(self, prompts: list[Prompt], params: SamplingParams, in_flight: int) -> JoinedAudio:
        return self.chat.pipeline.joined(prompts, params, True, in_flight)

    async def refine(self, texts: list[str], params: RefineTextParams) -> list[str]:
        """The refine pass, read on the event loop without a thread (the engine thread wakes it); a cancelled
        caller closes the stream, which aborts its engine requests."""
        pipeline = self.chat.pipeline
        stream = pipeline.submit(pipeline.text_prompts(texts, params), pipeline.text_params(params))
        final = {}
        try:
            async for out in stream:
                if out.finished:
                    final[out.request_id] = out.token_ids
        finally:
            stream.close()
        return refined_texts(self.kit.tokenizer, [final[rid] for rid in stream.request_ids])

    async def register_voice(self, name: str, wav: np.ndarray, transcript: str) -> Voice:
        # the DVAE encoder runs for a while: not on the event loop
        return await asyncio.to_thread(self.voices.register, name, wav, transcript)

    async def stats(self) -> EngineStats:
        return self.chat.engine.stats().engine

    def health(self) -> str | None:
        """None while the engine and the audio rounds run (``check_health`` of both: the rounds may have a thread
        of their own), else why not."""
        try:
            self.chat.engine.check_health(self.stall_s)
            self.chat.pipeline.pump.check_health(self.stall_s)
        except RuntimeError as e:
            return str(e)
        return None

    def close(self) -> None:
        if self.owns_chat:
            self.chat.unload()
