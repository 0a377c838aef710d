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

from .audio import StreamConfig
from .params import InferCodeParams, RefineTextParams
from .velocity import SILENCE

logger = logging.getLogger(__name__)


class Chat:
    RefineTextParams = RefineTextParams
    InferCodeParams = InferCodeParams

    def __init__(self, logger: logging.Logger | None = None):
        from .text import Normalizer

        self.logger = logger or logging.getLogger(__name__)
        self.normalizer = Normalizer(self.logger)
        self.model = None
        self.engine = None
        """The shared ``AsyncLLMEngine`` (after ``load``); ``engine.engine`` is the ``LLMEngine`` it steps."""

    # ------------------------------------------------------------------ loading
    def load(self, source: str = "local", force_redownload: bool = False, compile: bool = False,
             custom_path=None, device: torch.device | str | None = None, coef: str | None = None,
             use_flash_attn: bool = False, use_vllm: bool = False, experimental: bool = False,
             enable_cache: bool = True, load_format: str = "safetensors", *, block_size: int = 16,
             num_kv_blocks: int | None = None, kv_cache_gib: float | None = None, max_num_seqs: int = 64,
             max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
             engine_dtype: str = "float32", stream_config: StreamConfig | None = None) -> bool:
        """Load ChatTTS from ``source`` ("huggingface", "local" or "custom"; see ``resolve_model_dir``), or random
        full-size weights with ``load_format="dummy"``, and start the velocity engine over it.

        Engine settings (see ``EngineConfig``): ``block_size`` tokens per KV block; the KV cache as
        ``num_kv_blocks`` blocks or ``kv_cache_gib`` GiB (default: 40% of free GPU memory, 1 GiB on CPU);
        ``max_num_seqs`` sequences decoded together; ``max_num_batched_tokens`` tokens per step (longer prompts
        are prefilled in chunks); ``enable_prefix_caching``; ``engine_dtype`` of the Llama core;
        ``stream_config`` the streaming decode's chunking and context (``StreamConfig``).
        ``compile``, ``use_flash_attn``, ``use_vllm``, ``experimental`` and ``enable_cache`` are accepted for
        compatibility and change nothing. Returns True; raises ``ModelNotFoundError``/``ValueError``."""
        from .audio import AudioDecoder
        from .engine import AsyncLLMEngine, EngineConfig, LLMEngine
        from .model.loader import ModelLoader, resolve_model_dir
        from .reference import ReferencePath
        from .velocity import VelocityPath

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
        self.unload()
        self.model, self.device = model, device
        self.audio = AudioDecoder(model.dvae, model.decoder, model.vocos, device)
        self.engine = AsyncLLMEngine(LLMEngine.from_model(model, engine_config, device))
        self._velocity = VelocityPath(self.engine, model, self.audio, stream_config or StreamConfig())
        self._reference = ReferencePath(model, self.audio, device)
        self.logger.info("ChatTTS loaded from %s on %s", root or "random weights", device)
        return True

    def has_loaded(self, use_decoder: bool = False) -> bool:
        return self.model is not None

    def unload(self) -> None:
        """Stop the engine (requests in flight are aborted) and drop the model."""
        if self.engine is not None:
            self.engine.shutdown(drain=False)
        self.model = self.engine = None
        for name in ("audio", "_velocity", "_reference"):
            self.__dict__.pop(name, None)
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
        """Stop every ``infer`` call of this ``Chat`` running now after its current step; each returns (or
        streams) what was generated so far. To stop only one streaming call, close its generator."""
        if self.model is not None:
            self._velocity.interrupt()
            self._reference.interrupt()

    # ------------------------------------------------------------------ inference
    def infer(self, text, stream: bool = False, lang: str | None = None, skip_refine_text: bool = False,
              refine_text_only: bool = False, use_decoder: bool = True, do_text_normalization: bool = True,
              do_homophone_replacement: bool = True, split_text: bool = True, max_split_batch: int = 4,
              params_refine_text: RefineTextParams | None = None,
              params_infer_code: InferCodeParams | None = None, use_velocity: bool = True):
        """Text to 24 kHz float32 wavs, as upstream: a list of arrays (one, concatenated, when ``split_text``),
        refined texts with ``refine_text_only``, or a generator of [B, n] chunks with ``stream``.

        ``use_velocity=True`` runs every pass in the shared engine: any number of threads may call ``infer`` at
        once and their requests are batched together. Every text is its own request with the call's
        ``manual_seed`` (its audio does not depend on its neighbours) and is decoded at its own length; all
        texts of a call are submitted at once (``max_split_batch`` only groups the chunks of a stream). A
        stream decodes each chunk once, with ``stream_config``'s context (``stream_batch``, ``stream_speed``
        and ``pass_first_n_batches`` belong to upstream's protocol and are ignored); closing the generator
        aborts the call's requests. ``use_velocity=False`` runs the reference loop, which reproduces upstream
        exactly."""
        self._require()
        refine = params_refine_text if params_refine_text is not None else RefineTextParams()
        code = params_infer_code if params_infer_code is not None else InferCodeParams()
        refine.validate(1)
        code.validate(self.model.config.num_vq)
        if not isinstance(max_split_batch, int) or max_split_batch < 1:
            raise ValueError(f"max_split_batch must be an int >= 1, got {max_split_batch!r}")
        if not isinstance(use_velocity, bool):
            raise ValueError(f"use_velocity must be a bool, got {use_velocity!r}")
        texts = self._prepare_texts(text, split_text, lang, do_text_normalization, do_homophone_replacement)
        path = self._velocity if use_velocity else self._reference
        if not skip_refine_text:
            texts = self._refine(path, texts, refine)
            if refine_text_only:
                return "\n".join(texts) if split_text else texts
        if split_text and len(texts) > 1 and code.spk_smp is None:
            # upstream's split mode: the first sentence's audio becomes the voice sample of all sentences
            first = path.speak([texts[0]], code, use_decoder)[0]
            code = dataclasses.replace(code, spk_smp=self.sample_audio_speaker(first), txt_smp=texts[0])
        if stream:
            return self._stream(path, texts, code, use_decoder, max_split_batch if split_text else len(texts))
        batch = len(texts) if use_velocity or not split_text else max_split_batch
        wavs = [w for i in range(0, len(texts), batch) for w in path.speak(texts[i : i + batch], code, use_decoder)]
        stripped = [wav[np.abs(wav) > SILENCE] for wav in wavs]
        return [np.concatenate(stripped)] if split_text else stripped

    def _stream(self, path, texts: list[str], params: InferCodeParams, use_decoder: bool,
                batch: int) -> Iterator[np.ndarray]:
        for start in range(0, len(texts), batch):
            self.logger.info("infer split %d~%d", start, start + min(batch, len(texts) - start))
            yield from path.stream(texts[start : start + batch], params, use_decoder)

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

    def _refine(self, path, texts: list[str], params: RefineTextParams) -> list[str]:
        """Refined texts; ids from ``[break_0]`` on are dropped, as upstream does."""
        tok = self.model.tokenizer
        return tok.decode([ids[ids < tok.break_0_ids] for ids in path.refine(texts, params)])


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
