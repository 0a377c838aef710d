"""A speech request's body as the engine seam's parameters: its refine pass (``refine_params``) and its audio
pass with the resolved voice (``code_params``). The texts, prompts and their validation are the seam's
(``EngineClient.kit``), the same wherever the engine runs."""

from __future__ import annotations

from ..params import InferCodeParams, RefineTextParams
from ..serving.voices import Voice
from .schema import SpeechRequest
from .settings import ServerConfig


def refine_params(body: SpeechRequest) -> RefineTextParams:
    """The refine pass of a request that asks for one (``body.refines``)."""
    return RefineTextParams(prompt=body.refine_prompt() or "", manual_seed=body.seed, show_tqdm=False)


def code_params(body: SpeechRequest, voice: Voice, config: ServerConfig) -> InferCodeParams:
    """The audio pass: the voice's speaker and sample, the body's sampling, the server's token limits."""
    return InferCodeParams(
        prompt=body.speed_prompt(), spk_emb=voice.spk_emb, spk_smp=voice.spk_smp, txt_smp=voice.txt_smp,
        temperature=body.temperature, top_P=body.top_p, top_K=body.top_k, manual_seed=body.seed, show_tqdm=False,
        max_new_token=config.max_new_token, min_new_token=config.min_new_token,
    )
