"""A speech request turned into what the engine runs: its sentences, voice and parameters, validated.

In one process the server does it with the loaded ``Chat`` (``prepare_speech``). With ``--engine-process`` the
HTTP front does it itself from a ``SpeechKit`` (the tokenizer, the model's config and speaker statistics, the
KV capacity: what preparing needs of the model, sent over by the engine process once) and hands the engine
process prompts ready to run (``prepare_prompts``): the response's headers then wait for no round trip to a
process whose threads compete with its engine thread for the GIL. A request with a refine pass needs the engine
for it, and is prepared in the engine process."""

from __future__ import annotations

from ..engine import Mode, Prompt, SamplingParams
from ..engine.llm_engine import validate_request
from ..params import InferCodeParams, RefineTextParams
from ..velocity import JoinedAudio, code_prompts, sampling_params
from .config import ServerConfig
from .schema import SpeechRequest
from .voices import VoiceRegistry


class SpeechKit:
    """What preparing a speech request needs of a loaded model, without the model. Picklable (its normalizer is
    built again where it is unpickled). Reads like a ``Chat`` where ``speech_plan`` and ``VoiceRegistry`` read
    one (``model.tokenizer``, ``model.config``, ``model.speaker_stats``, ``_prepare_texts``)."""

    def __init__(self, tokenizer, config, speaker_stats, kv_capacity: int):
        from ..text import Normalizer

        self.tokenizer, self.config, self.speaker_stats = tokenizer, config, speaker_stats
        self.kv_capacity = kv_capacity
        self.normalizer = Normalizer()

    @classmethod
    def of(cls, chat) -> SpeechKit:
        model = chat.model
        return cls(model.tokenizer, model.config, model.speaker_stats, chat.engine.engine.kv_capacity)

    def __reduce__(self):
        return SpeechKit, (self.tokenizer, self.config, self.speaker_stats, self.kv_capacity)

    @property
    def model(self) -> SpeechKit:
        return self

    def _prepare_texts(self, text, split_text, lang, do_norm, do_homophone) -> list[str]:
        from ..text import model_texts

        return model_texts(self, self.normalizer, text, split_text, lang, do_norm, do_homophone)


def speech_plan(chat, voices: VoiceRegistry, config: ServerConfig, body: SpeechRequest
                ) -> tuple[list[str], InferCodeParams]:
    """The request's sentences (refined if it asks for it: ``chat`` must then be a loaded ``Chat``) and its
    code parameters; ``UnknownVoiceError`` or ``ValueError`` says what is wrong with it."""
    voice = voices.resolve(body.voice)
    texts = chat._prepare_texts(body.input, True, None, True, True)
    if body.refines:
        params = RefineTextParams(prompt=body.refine_prompt() or "", manual_seed=body.seed, show_tqdm=False)
        texts = chat._refine(chat._velocity, texts, params)
    code = InferCodeParams(
        prompt=body.speed_prompt(), spk_emb=voice.spk_emb, spk_smp=voice.spk_smp, txt_smp=voice.txt_smp,
        temperature=body.temperature, top_P=body.top_p, top_K=body.top_k, manual_seed=body.seed, show_tqdm=False,
        max_new_token=config.max_new_token, min_new_token=config.min_new_token,
    )
    return texts, code


def prepare_speech(chat, voices: VoiceRegistry, config: ServerConfig, body: SpeechRequest) -> JoinedAudio:
    """Sentences, voice and parameters of a request, validated; the audio iterator (nothing runs yet)."""
    texts, code = speech_plan(chat, voices, config, body)
    return chat._velocity.stream_joined(texts, code, use_decoder=True, in_flight=config.in_flight_sentences)


def prepare_prompts(kit: SpeechKit, voices: VoiceRegistry, config: ServerConfig, body: SpeechRequest
                    ) -> tuple[list[Prompt], SamplingParams]:
    """``prepare_speech`` without the model (no refine pass): the prompts and parameters an engine process
    runs (``VelocityPath.joined``), validated as its engine validates them."""
    if body.refines:
        raise ValueError("a refine pass needs the engine: prepare the request in the engine process")
    texts, code = speech_plan(kit, voices, config, body)
    prompts = code_prompts(kit.tokenizer, kit.config, texts, code)
    params = sampling_params(code, Mode.CODE, kit.config.num_vq)
    for i, prompt in enumerate(prompts):
        try:
            validate_request(kit.config, kit.kv_capacity, prompt, params)
        except ValueError as e:
            raise ValueError(f"sentence {i + 1}: {e}" if len(prompts) > 1 else str(e)) from None
    return prompts, params
