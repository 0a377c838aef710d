"""``SpeechKit``: what preparing a speech request needs of a loaded model, without the model (the tokenizer, the
model's config and speaker statistics, the KV capacity, the text normaliser). A front prepares and validates
every request with it, so the 4xx answers are the same whether the engine runs in this process or another, and
the response's headers wait for no round trip to the engine."""

from __future__ import annotations

from ..engine import Mode, Prompt, SamplingParams, validate_request
from ..params import InferCodeParams
from ..pipeline import code_prompts, sampling_params
from ..text import Normalizer, model_texts


class SpeechKit:
    """Texts, prompts and their validation for one model. Picklable: an engine process sends it to its fronts
    once (the normaliser is built again where it is unpickled; one given here is not sent)."""

    def __init__(self, tokenizer, config, speaker_stats, kv_capacity: int, normalizer: Normalizer | None = None):
        self.tokenizer = tokenizer
        self.config = config
        """The model's ``ModelConfig`` (vocabulary sizes, context, ``num_vq``, ``hidden_size``)."""
        self.speaker_stats = speaker_stats
        """The checkpoint's ``SpeakerStats`` (built-in voices are drawn from them), or None."""
        self.kv_capacity = kv_capacity
        """Tokens the engine's KV cache holds (a prompt must leave room to generate)."""
        self.normalizer = normalizer or Normalizer()

    @classmethod
    def of(cls, chat) -> SpeechKit:
        """The kit of a loaded ``Chat`` (its own normaliser, with whatever normalisers were registered on it)."""
        model = chat.model
        return cls(model.tokenizer, model.config, model.speaker_stats, chat.engine.kv_capacity, chat.normalizer)

    def __reduce__(self):
        return SpeechKit, (self.tokenizer, self.config, self.speaker_stats, self.kv_capacity)

    def prepare_texts(self, text: str) -> list[str]:
        """``text`` as the sentences to speak, normalised and split as ``Chat.prepare_texts`` does (language
        detected, homophones replaced); ``ValueError`` if nothing readable is left."""
        return model_texts(self, self.normalizer, text, True, None, True, True)

    def prompts(self, texts: list[str], p: InferCodeParams) -> tuple[list[Prompt], SamplingParams]:
        """The audio-code prompts of ``texts`` and their parameters, validated as the engine validates them
        (``ValueError`` naming the sentence): what ``EngineClient.start`` runs."""
        prompts = code_prompts(self.tokenizer, self.config, texts, p)
        params = sampling_params(p, Mode.CODE, self.config.num_vq)
        for i, prompt in enumerate(prompts):
            try:
                validate_request(self.config, self.kv_capacity, prompt, params)
            except ValueError as e:
                raise ValueError(f"sentence {i + 1}: {e}" if len(prompts) > 1 else str(e)) from None
        return prompts, params
