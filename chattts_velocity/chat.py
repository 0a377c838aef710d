"""``Chat``: upstream ChatTTS's API (same names, defaults and semantics) over our loader, text front end,
reference decode and audio decoder.

Deliberate deviations from upstream, each a fix:
- parameter objects are never mutated (upstream writes ``spk_smp``/``txt_smp`` into the caller's, even the
  shared default, ``InferCodeParams``);
- bad input raises a ``ValueError`` that says what to fix, before any work: empty text, out-of-range params,
  malformed speaker strings, text longer than the model's context;
- ``load`` raises a clear error instead of logging and returning ``False``;
- blank pieces of a newline split are dropped (upstream synthesises them as empty prompts);
- in ``stream`` mode the chunk position restarts with each ``max_split_batch`` batch (upstream carries it over
  and skips audio of later batches).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import numpy as np
import torch

from .params import InferCodeParams, RefineTextParams
from .reference import DecodeSettings, GenerationOutput, reference_generate
from .velocity import velocity_generate

logger = logging.getLogger(__name__)
_SILENCE = np.float32(1e-5)


class Chat:
    RefineTextParams = RefineTextParams
    InferCodeParams = InferCodeParams

    def __init__(self, logger: logging.Logger | None = None):
        from .text import Normalizer

        self.logger = logger or logging.getLogger(__name__)
        self.normalizer = Normalizer(self.logger)
        self.model = None
        self._interrupted = False

    # ------------------------------------------------------------------ loading
    def load(self, source: str = "local", force_redownload: bool = False, compile: bool = False,
             custom_path=None, device: torch.device | str | None = None, coef: str | None = None,
             use_flash_attn: bool = False, use_vllm: bool = False, experimental: bool = False,
             enable_cache: bool = True, load_format: str = "safetensors", *, block_size: int = 16,
             num_kv_blocks: int | None = None, kv_cache_gib: float | None = None, max_num_seqs: int = 64,
             max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
             engine_dtype: str = "float32") -> bool:
        """Load ChatTTS from ``source`` ("huggingface", "local" or "custom"; see ``resolve_model_dir``), or random
        full-size weights with ``load_format="dummy"``, and start the velocity engine over it.

        Engine settings (see ``EngineConfig``): ``block_size`` tokens per KV block; the KV cache as
        ``num_kv_blocks`` blocks or ``kv_cache_gib`` GiB (default: 40% of free GPU memory, 1 GiB on CPU);
        ``max_num_seqs`` sequences decoded together; ``max_num_batched_tokens`` tokens per step (longer prompts
        are prefilled in chunks); ``enable_prefix_caching``; ``engine_dtype`` of the Llama core.
        ``compile``, ``use_flash_attn``, ``use_vllm``, ``experimental`` and ``enable_cache`` are accepted for
        compatibility and change nothing. Returns True; raises ``ModelNotFoundError``/``ValueError``."""
        from .audio import AudioDecoder
        from .engine import EngineConfig, LLMEngine
        from .model.loader import ModelLoader, resolve_model_dir

        engine_config = EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_gib=kv_cache_gib,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, dtype=engine_dtype,
        )
        device = torch.device(device) if device is not None else _default_device()
        loader = ModelLoader(device, load_format)
        root = None if load_format == "dummy" else resolve_model_dir(source, custom_path, force_redownload)
        model = loader.load(root)
        if coef is not None:
            _set_coef(model, coef)
        self.model, self.device = model, device
        self.audio = AudioDecoder(model.dvae, model.decoder, model.vocos, device)
        self.engine = LLMEngine.from_model(model, engine_config, device)
        self.logger.info("ChatTTS loaded from %s on %s", root or "random weights", device)
        return True

    def has_loaded(self, use_decoder: bool = False) -> bool:
        return self.model is not None

    def unload(self) -> None:
        self.model = None
        self.__dict__.pop("audio", None)
        self.__dict__.pop("engine", None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _require(self):
        if self.model is None:
            raise RuntimeError("no model loaded: call Chat.load() first")
        return self.model

    # ------------------------------------------------------------------ speakers
    def sample_random_speaker(self) -> str:
        """A random speaker string from the checkpoint's speaker statistics."""
        model = self._require()
        if model.speaker_stats is None:
            raise ValueError(
                f"this checkpoint (hidden size {model.config.hidden_size}) has no speaker statistics "
                "(asset/spk_stat.safetensors), so random speakers cannot be sampled; pass spk_emb strings made "
                "for this model, or write the checkpoint with `chattts-velocity make-checkpoint`"
            )
        return model.speaker_stats.sample_random()

    def sample_audio_speaker(self, wav: np.ndarray | torch.Tensor) -> str:
        """A voice-sample string (``spk_smp``) from a 24 kHz mono wav, through the DVAE encoder."""
        from .text import encode_prompt

        self._require()
        return encode_prompt(self.audio.sample_audio(wav))

    def interrupt(self) -> None:
        """Stop the running ``infer`` after its current step; it returns what was generated so far."""
        self._interrupted = True

    # ------------------------------------------------------------------ inference
    def infer(self, text, stream: bool = False, lang: str | None = None, skip_refine_text: bool = False,
              refine_text_only: bool = False, use_decoder: bool = True, do_text_normalization: bool = True,
              do_homophone_replacement: bool = True, split_text: bool = True, max_split_batch: int = 4,
              params_refine_text: RefineTextParams | None = None,
              params_infer_code: InferCodeParams | None = None, use_velocity: bool = True):
        """Text to 24 kHz float32 wavs, as upstream: a list of arrays (one, concatenated, when ``split_text``),
        refined texts with ``refine_text_only``, or a generator of [B, n] chunks with ``stream``.

        ``use_velocity=True`` decodes refine and code passes with the velocity engine: every text is its own
        request with the call's ``manual_seed`` (so its audio does not depend on its neighbours) and is decoded
        to its own length. ``use_velocity=False`` runs the reference loop, which reproduces upstream exactly."""
        model = self._require()
        self._interrupted = False
        refine = params_refine_text if params_refine_text is not None else RefineTextParams()
        code = params_infer_code if params_infer_code is not None else InferCodeParams()
        refine.validate(1)
        code.validate(model.config.num_vq)
        texts = self._prepare_texts(text, split_text, lang, do_text_normalization, do_homophone_replacement)
        if not isinstance(max_split_batch, int) or max_split_batch < 1:
            raise ValueError(f"max_split_batch must be an int >= 1, got {max_split_batch!r}")
        if not isinstance(use_velocity, bool):
            raise ValueError(f"use_velocity must be a bool, got {use_velocity!r}")
        if not skip_refine_text:
            texts = self._refine(texts, refine, use_velocity)
            if refine_text_only:
                return "\n".join(texts) if split_text else texts
        gen = self._infer_audio(texts, stream, use_decoder, split_text, max_split_batch, code, use_velocity)
        if stream:
            return gen
        stripped = [wav[np.abs(wav) > _SILENCE] for wavs in gen for wav in wavs]
        return [np.concatenate(stripped)] if split_text else stripped

    def _prepare_texts(self, text, split_text, lang, do_norm, do_homophone) -> list[str]:
        from .text import split_long
        from .text import split_text as split_sentences

        if isinstance(text, str):
            if not text.strip():
                raise ValueError("text is empty: give at least one non-blank string")
            texts = [t for t in split_sentences(text) if t.strip()] if split_text else [text]
        elif isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text):
            blank = [i for i, t in enumerate(text) if not t.strip()]
            if blank:
                raise ValueError(f"text[{blank[0]}] is empty: every text must be a non-blank string")
            texts = list(text)
        else:
            raise ValueError("text must be a non-empty str or a non-empty list of str")
        if lang not in (None, "zh", "en"):
            raise ValueError(f"lang must be None, 'zh' or 'en', got {lang!r}")
        texts = [self.normalizer(t, do_norm, do_homophone, lang) for t in texts]
        limit = self.model.config.max_position_embeddings // 2
        tok = self.model.tokenizer
        if split_text:
            texts = [piece for t in texts for piece in split_long(t, tok.count, limit)]
        return texts

    def _refine(self, texts: list[str], params: RefineTextParams, velocity: bool) -> list[str]:
        """Refined texts; ids from ``[break_0]`` on are dropped, as upstream does."""
        tok = self._require().tokenizer
        return tok.decode([ids[ids < tok.break_0_ids] for ids in self._refine_ids(texts, params, velocity).ids])

    def _refine_ids(self, texts: list[str], params: RefineTextParams, velocity: bool = False) -> GenerationOutput:
        from .text import decorate_text_prompts

        tok = self._require().tokenizer
        settings = _settings(params, text_mode=True, eos_id=tok.eos_token, row_cap=tok.len,
                             temperature=params.temperatures(1))
        prompts = decorate_text_prompts(texts, params.prompt)
        return _last(self._generate(prompts, settings, None, None, stream=False, velocity=velocity))

    def _infer_audio(self, texts, stream, use_decoder, split_text, max_split_batch, params: InferCodeParams,
                     velocity: bool):
        if split_text and len(texts) > 1 and params.spk_smp is None:
            first = _last(self._infer_code([texts[0]], False, params, velocity))
            wavs = self._wavs(first, use_decoder, velocity)
            params = dataclasses.replace(params, spk_smp=self.sample_audio_speaker(wavs[0]), txt_smp=texts[0])
        if not split_text:
            max_split_batch = len(texts)
        for start in range(0, len(texts), max_split_batch):
            batch = texts[start : start + max_split_batch]
            if split_text:
                self.logger.info("infer split %d~%d", start, start + len(batch))
            results = self._infer_code(batch, stream, params, velocity)
            if stream:
                yield from self._stream_chunks(results, use_decoder, params, velocity)
            else:
                for res in results:
                    yield self._wavs(res, use_decoder, velocity)

    def _wavs(self, res: GenerationOutput, use_decoder: bool, velocity: bool) -> list[np.ndarray]:
        """Velocity: every sequence decoded at its own length, TF32 on CUDA. Reference: one zero-padded batch
        at torch's default precision, as upstream (whose silence stripping reacts to the last bit)."""
        seqs = res.hiddens if use_decoder else res.ids
        if velocity:
            return self.audio.to_wav_list(seqs, use_decoder)
        return list(self.audio.to_wavs(seqs, use_decoder, tf32=False))

    def _stream_chunks(self, results: Iterator[GenerationOutput], use_decoder: bool, params: InferCodeParams,
                       velocity: bool) -> Iterator[np.ndarray]:
        length, seen, wavs = 0, 0, None
        for res in results:
            wavs = self.audio.to_wavs(res.hiddens if use_decoder else res.ids, use_decoder, tf32=velocity)
            seen += 1
            if seen <= params.pass_first_n_batches:
                continue
            end = min(length + params.stream_speed, wavs.shape[1])
            yield wavs[:, length:end]
            length = end
        tail = wavs[:, length:]
        yield tail[:, np.sum(np.abs(tail) > _SILENCE, axis=0) > 0]

    def _infer_code(self, texts: list[str], stream: bool, params: InferCodeParams,
                    velocity: bool = False) -> Iterator[GenerationOutput]:
        from .text import decode_prompt, decorate_code_prompts, speaker_vector

        model = self._require()
        cfg = model.config
        prompt = None
        if params.spk_smp is not None:
            prompt = decode_prompt(params.spk_smp, num_vq=cfg.num_vq, num_codes=cfg.num_audio_tokens)
        spk_vec = speaker_vector(params.spk_emb, cfg.hidden_size) if params.spk_emb is not None else None
        prompts = decorate_code_prompts(texts, params.prompt, params.txt_smp, params.spk_emb is not None)
        settings = _settings(params, text_mode=False, eos_id=cfg.eos_code, row_cap=cfg.eos_code,
                             temperature=params.temperatures(cfg.num_vq), stream_batch=params.stream_batch)
        return self._generate(prompts, settings, prompt, spk_vec, stream, velocity)

    def _generate(self, prompts: list[str], settings: DecodeSettings, prompt_codes, spk_vec,
                  stream: bool, velocity: bool = False) -> Iterator[GenerationOutput]:
        model = self._require()
        cfg = model.config
        input_ids, attention_mask, text_mask = model.tokenizer.encode(prompts, cfg.num_vq, prompt=prompt_codes)
        length = input_ids.shape[1]
        room = cfg.max_position_embeddings - length
        if room <= 0:
            raise ValueError(
                f"text is longer than the model's context: the prompt (text, tags and any voice-sample transcript "
                f"txt_smp) has {length} tokens, the model holds {cfg.max_position_embeddings}; shorten the text or "
                "txt_smp, or let infer split it (split_text=True)"
            )
        if velocity:  # the engine caps each request by its own room
            return velocity_generate(self.engine, model.tokenizer, prompts, settings, prompt_codes, spk_vec, stream,
                                     interrupted=lambda: self._interrupted)
        if settings.max_new_token > room:
            self.logger.warning("max_new_token %d capped to %d by the model's context", settings.max_new_token, room)
            settings = dataclasses.replace(settings, max_new_token=room,
                                           min_new_token=min(settings.min_new_token, room))
        dev = self.device
        return reference_generate(
            model.gpt, input_ids.to(dev), attention_mask.to(dev), text_mask.to(dev), settings,
            spk_id=model.tokenizer.spk_emb_ids, spk_vec=spk_vec, stream=stream,
            interrupted=lambda: self._interrupted,
        )


def _settings(params: RefineTextParams, text_mode: bool, eos_id: int, row_cap: int,
              temperature: tuple[float, ...], stream_batch: int = 24) -> DecodeSettings:
    return DecodeSettings(
        text_mode=text_mode, temperature=temperature, top_p=params.top_P, top_k=params.top_K,
        repetition_penalty=params.repetition_penalty, max_new_token=params.max_new_token,
        min_new_token=params.min_new_token, eos_id=eos_id, penalty_row_cap=row_cap,
        manual_seed=params.manual_seed, ensure_non_empty=params.ensure_non_empty, stream_batch=stream_batch,
        show_tqdm=params.show_tqdm,
    )


def _last(results: Iterator[GenerationOutput]) -> GenerationOutput:
    """The final output of a (non-streaming) generation."""
    outputs = list(results)
    assert outputs, "reference_generate always yields a final output"
    return outputs[-1]


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _set_coef(model, coef: str) -> None:
    """Upstream's ``coef``: a base16384 string of 100 float32 mel scales for the DVAE and the Decoder."""
    import pybase16384 as b14

    try:
        values = np.frombuffer(b14.decode_from_string(coef), dtype=np.float32).copy()
    except Exception as e:  # noqa: BLE001 - any decoding failure is the caller's malformed string
        raise ValueError(f"malformed coef string: {e}") from None
    for m in (model.dvae, model.decoder):
        if values.size != m.coef.numel():
            raise ValueError(f"coef has {values.size} values, the DVAE needs {m.coef.numel()}")
        m.coef.copy_(torch.from_numpy(values).view_as(m.coef))
