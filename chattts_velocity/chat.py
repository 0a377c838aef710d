"""``Chat``: upstream ChatTTS's API (same names, defaults and semantics) over our loader, text front end,
reference decode and audio decoder.

Deliberate deviations from upstream, each a fix:
- parameter objects are never mutated (upstream writes ``spk_smp``/``txt_smp`` into the caller's, even the
  shared default, ``InferCodeParams``);
- bad input raises a ``ValueError`` that says what to fix, before any work: empty text or text with nothing
  readable left after normalisation, out-of-range params, malformed speaker strings, an unknown device;
- ``load`` raises a clear error instead of logging and returning ``False``, and is atomic: a failed load
  leaves the previous model loaded and usable;
- an interrupt during the refine pass ends the call without audio and says so (upstream returns an empty wav
  silently); NaN samples are kept, never dropped as silence;
- blank pieces of a newline split are dropped (upstream synthesises them as empty prompts);
- in ``stream`` mode the chunk position restarts with each ``max_split_batch`` batch (upstream carries it over
  and skips audio of later batches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pybase16384 as b14
import torch

from .audio import AudioDecoder, StreamConfig
from .audio.silence import audible
from .cpu_threads import on_own_thread
from .device import resolve_device
from .engine import AsyncLLMEngine, EngineConfig, EngineShutdownError, LLMEngine
from .gc_freeze import freeze_long_lived, thaw
from .model.loader import LoadedModel, ModelLoader
from .params import InferCodeParams, RefineTextParams
from .pipeline import Pipeline, refined_texts
from .reference import ReferencePath
from .text import Normalizer, encode_prompt, model_texts
from .upstream_api import UpstreamAttributes

logger = logging.getLogger(__name__)

STOP_WAIT_S = 60.0
"""How long ``Chat.unload`` (or a new ``load``) waits for the engine thread to stop."""

_UNLOADED = ("the model was unloaded during this infer call (Chat.unload or another Chat.load ran), which stopped "
             "its requests: call Chat.load() again, then infer")


@dataclass(frozen=True)
class _Loaded:
    """Everything one ``load`` built. It is swapped in whole, so a failed load changes nothing, and a call
    keeps the one it started with."""

    model: LoadedModel
    device: torch.device
    audio: AudioDecoder
    engine: AsyncLLMEngine
    pipeline: Pipeline
    reference: ReferencePath

    def close(self) -> None:
        """Stop the engine (its requests in flight are aborted), waiting for its thread up to ``STOP_WAIT_S``
        (it ends after the step it is in; one that does not, a hung device call, is left behind)."""
        self.engine.shutdown(drain=False, timeout=STOP_WAIT_S)


class Chat(UpstreamAttributes):
    """ChatTTS's ``Chat``; upstream's public attributes of a loaded one come from ``UpstreamAttributes``."""

    RefineTextParams = RefineTextParams
    InferCodeParams = InferCodeParams

    def __init__(self, logger: logging.Logger | None = None):
        self.logger = logger or logging.getLogger(__name__)
        self.normalizer = Normalizer(self.logger)
        self._loaded: _Loaded | None = None

    @property
    def model(self) -> LoadedModel | None:
        """The loaded model (None before ``load``)."""
        return None if self._loaded is None else self._loaded.model

    @property
    def engine(self) -> AsyncLLMEngine | None:
        """The shared ``AsyncLLMEngine`` (after ``load``)."""
        return None if self._loaded is None else self._loaded.engine

    @property
    def device(self) -> torch.device:
        return self._require().device

    @property
    def audio(self) -> AudioDecoder:
        return self._require().audio

    @property
    def pipeline(self) -> Pipeline:
        """The velocity pipeline over the shared engine (what ``infer(use_velocity=True)`` runs; a front's
        ``LocalClient`` runs requests through it too)."""
        return self._require().pipeline

    @property
    def reference(self) -> ReferencePath:
        """The reference decode (``infer(use_velocity=False)``), which reproduces upstream exactly."""
        return self._require().reference

    # ------------------------------------------------------------------ loading
    def load(self, source: str = "local", force_redownload: bool = False, compile: bool = False,
             custom_path=None, device: torch.device | str | None = None, coef: str | None = None,
             use_flash_attn: bool = False, use_vllm: bool = False, experimental: bool = False,
             enable_cache: bool = True, load_format: str = "safetensors", *, block_size: int = 16,
             num_kv_blocks: int | None = None, kv_cache_gib: float | None = None, max_num_seqs: int = 64,
             max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
             engine_dtype: str = "float32", max_window_tokens: int | None = None,
             open_window_max_seqs: int = 16, window_stops: tuple[int, ...] = EngineConfig.window_stops,
             window_budget_ms: float | None = EngineConfig.window_budget_ms,
             stream_config: StreamConfig | None = None) -> bool:
        """Load ChatTTS from ``source`` ("huggingface", "local" or "custom"; see ``resolve_model_dir``), or random
        full-size weights with ``load_format="dummy"``, and start the velocity engine over it.

        Engine settings (see ``EngineConfig``): ``block_size`` tokens per KV block; the KV cache as
        ``num_kv_blocks`` blocks or ``kv_cache_gib`` GiB (default: 40% of free GPU memory, 1 GiB on CPU);
        ``max_num_seqs`` sequences decoded together; ``max_num_batched_tokens`` tokens per step (longer prompts
        are prefilled in chunks; default 8,192 on CUDA, 2,048 on CPU); ``enable_prefix_caching``;
        ``engine_dtype`` of the Llama core;
        ``max_window_tokens`` caps a decode window's steps x sequences (shorter waits for arriving requests);
        a window of at most ``open_window_max_seqs`` sequences ends early for a request that arrives (0: never);
        ``window_stops`` where a young stream's decode windows end (its first chunks); ``window_budget_ms`` the
        longest a full window runs at the latest step time (None: every window ``num_decode_steps`` steps);
        ``stream_config`` the streaming decode's chunking and context (``StreamConfig``).
        ``compile``, ``use_flash_attn``, ``use_vllm``, ``experimental`` and ``enable_cache`` are accepted for
        compatibility and change nothing.

        On CUDA the objects alive after loading (the model's, the libraries') are frozen out of the garbage
        collector's scans (``gc_freeze.freeze_long_lived``): a full collection walking them would pause a
        many-stream generation. ``unload``, and a load that replaces a model, thaw them first.

        Atomic: everything new is built before the previous model is let go, so a load that fails leaves the
        previous one loaded and usable (while both exist, both take memory). Returns True; raises
        ``ModelNotFoundError``/``ValueError``."""
        engine_config = EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_gib=kv_cache_gib,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, dtype=engine_dtype, max_window_tokens=max_window_tokens,
            open_window_max_seqs=open_window_max_seqs, window_stops=window_stops, window_budget_ms=window_budget_ms,
        )
        device = resolve_device(device)
        loader = ModelLoader(device, load_format)
        root = None if load_format == "dummy" else self.download_models(source, force_redownload, custom_path)
        def build() -> _Loaded:  # (on the CPU on a thread of its own: ``cpu_threads.on_own_thread``)
            model = loader.load(root)
            if coef is not None:
                _set_coef(model, coef)
            return _build(model, device, engine_config, stream_config or StreamConfig())

        loaded = on_own_thread(device, build)
        previous, self._loaded = self._loaded, loaded
        if previous is not None:
            thaw()
            previous.close()
        if device.type == "cuda":  # (see ``gc_freeze``: full collections of the loaded model's objects)
            freeze_long_lived()
        self.logger.info("ChatTTS loaded from %s on %s", root or "random weights", device)
        return True

    def has_loaded(self, use_decoder: bool = False) -> bool:
        return self.model is not None

    def unload(self) -> None:
        """Stop the engine and drop the model. An ``infer`` running now raises a ``RuntimeError`` saying so."""
        previous, self._loaded = self._loaded, None
        if previous is not None:
            thaw()
            previous.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _require(self) -> _Loaded:
        loaded = self._loaded
        if loaded is None:
            raise RuntimeError("no model loaded: call Chat.load() first")
        return loaded

    # ------------------------------------------------------------------ speakers
    def sample_random_speaker(self) -> str:
        """A random speaker string from the checkpoint's speaker statistics."""
        model = self._require().model
        if model.speaker_stats is None:
            raise ValueError(
                f"this checkpoint (hidden size {model.config.hidden_size}) has no speaker statistics "
                "(asset/spk_stat.safetensors), so random speakers cannot be sampled; pass spk_emb strings made "
                "for this model, or write the checkpoint with `chattts-velocity make-checkpoint`"
            )
        return model.speaker_stats.sample_random()

    def sample_audio_speaker(self, wav: np.ndarray | torch.Tensor) -> str:
        """A voice-sample string (``spk_smp``) from a 24 kHz mono wav, through the DVAE encoder (on the CPU on a
        thread of its own: ``cpu_threads.on_own_thread``)."""
        loaded = self._require()
        return on_own_thread(loaded.audio.device, _voice_sample, loaded, wav)

    def interrupt(self) -> None:
        """Stop every ``infer`` call of this ``Chat`` running now after its current step; each returns (or
        streams) what was generated so far, and warns. A call interrupted before its audio pass (during the
        refine pass) returns no audio. To stop only one streaming call, close its generator."""
        loaded = self._loaded
        if loaded is not None:
            loaded.pipeline.interrupt()
            loaded.reference.interrupt()

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
        state = self._require()
        cfg = state.model.config
        refine = _params(params_refine_text, RefineTextParams, "params_refine_text").checked(1, cfg.num_text_tokens)
        code = _params(params_infer_code, InferCodeParams, "params_infer_code").checked(cfg.num_vq,
                                                                                        cfg.num_audio_tokens)
        if not isinstance(max_split_batch, int) or max_split_batch < 1:
            raise ValueError(f"max_split_batch must be an int >= 1, got {max_split_batch!r}")
        if not isinstance(use_velocity, bool):
            raise ValueError(f"use_velocity must be a bool, got {use_velocity!r}")
        texts = self.prepare_texts(text, split_text, lang, do_text_normalization, do_homophone_replacement)
        path = state.pipeline if use_velocity else state.reference
        start = path.interrupts
        with self._serving(state):
            if not skip_refine_text:
                texts = self._refine(path, texts, refine)
                if refine_text_only:
                    if path.interrupts != start:
                        self.logger.warning("infer was interrupted: the texts are refined only so far")
                    return "\n".join(texts) if split_text else texts
            if split_text and len(texts) > 1 and code.spk_smp is None and path.interrupts == start:
                code = self._with_voice_sample(state, path, texts[0], code, use_decoder)
        if path.interrupts != start:  # before the audio pass: nothing to return
            self.logger.warning("infer was interrupted before its audio pass (refine or voice sample): no audio")
            return iter(()) if stream else [np.zeros(0, np.float32)] * (1 if split_text else len(texts))
        if stream:
            batch = max_split_batch if split_text else len(texts)
            return self._stream(state, path, texts, code, use_decoder, batch, start)
        with self._serving(state):
            batch = len(texts) if use_velocity or not split_text else max_split_batch
            wavs = [w for i in range(0, len(texts), batch) for w in path.speak(texts[i : i + batch], code, use_decoder)]
        self._report(wavs, path.interrupts != start)
        kept = [wav[audible(wav)] for wav in wavs]
        return [np.concatenate(kept)] if split_text else kept

    def _with_voice_sample(self, state: _Loaded, path, text: str, code: InferCodeParams,
                           use_decoder: bool) -> InferCodeParams:
        """Upstream's split mode: the first sentence's audio becomes the voice sample of all sentences (unless
        it is too short to encode: then they go without one, as a single text would)."""
        first = path.speak([text], code, use_decoder)[0]
        try:
            sample = _voice_sample(state, first)
        except ValueError as e:
            self.logger.warning("the first sentence's audio cannot be the voice sample of the others (%s); they "
                                "are generated without one", e)
            return code
        return dataclasses.replace(code, spk_smp=sample, txt_smp=text)

    @contextlib.contextmanager
    def _serving(self, state: _Loaded) -> Iterator[None]:
        """Turn an engine shut down under a running call (``unload`` or another ``load``) into a clear error."""
        try:
            yield
        except EngineShutdownError:
            raise RuntimeError(_UNLOADED) from None
        if self._loaded is not state:
            raise RuntimeError(_UNLOADED)

    def _report(self, wavs: list[np.ndarray], interrupted: bool) -> None:
        """Warn about what the caller would otherwise not see: an interrupt, non-finite samples."""
        if interrupted:
            self.logger.warning("infer was interrupted: returning the audio generated before the interrupt")
        for i, wav in enumerate(wavs):
            bad = int(np.count_nonzero(~np.isfinite(wav)))
            if bad:
                self.logger.warning("wav %d has %d NaN or infinite samples: the model computed non-finite "
                                    "numbers (with engine_dtype float16, try float32)", i, bad)

    def _stream(self, state: _Loaded, path, texts: list[str], params: InferCodeParams, use_decoder: bool,
                batch: int, start: int) -> Iterator[np.ndarray]:
        for first in range(0, len(texts), batch):
            self.logger.info("infer split %d~%d", first, first + min(batch, len(texts) - first))
            with self._serving(state):
                yield from path.stream(texts[first : first + batch], params, use_decoder)
            if path.interrupts != start:
                self.logger.warning("infer was interrupted: the stream ends with the audio generated before it")
                return

    def prepare_texts(self, text, split_text: bool = True, lang: str | None = None,
                      do_text_normalization: bool = True, do_homophone_replacement: bool = True) -> list[str]:
        """``text`` (a str or a list of str) as the texts ``infer`` synthesises: normalised and, with
        ``split_text``, split into sentences (see ``text.prepare_texts``); ``ValueError`` if nothing readable
        is left."""
        return model_texts(self._require().model, self.normalizer, text, split_text, lang, do_text_normalization,
                           do_homophone_replacement)

    def _refine(self, path, texts: list[str], params: RefineTextParams) -> list[str]:
        """Refined texts (``pipeline.refined_texts``)."""
        return refined_texts(path.model.tokenizer, path.refine(texts, params))


def _params(value, cls: type, name: str):
    """``value``, which must be a ``cls`` (None: the defaults)."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        how = f"Chat.{cls.__name__}(**{name})" if isinstance(value, dict) else f"Chat.{cls.__name__}(...)"
        raise TypeError(f"{name} must be a Chat.{cls.__name__}, got {type(value).__name__}: build one with {how}")
    return value


def _voice_sample(state: _Loaded, wav: np.ndarray) -> str:
    """The voice-sample string of ``wav`` through ``state``'s DVAE encoder."""
    return encode_prompt(state.audio.sample_audio(wav))


def _build(model, device: torch.device, engine_config, stream_config: StreamConfig) -> _Loaded:
    """The audio decoder, engine and both paths over ``model``; nothing is shared with a previous load."""
    audio = AudioDecoder(model.dvae, model.decoder, model.vocos, device)
    engine = AsyncLLMEngine(LLMEngine.from_model(model, engine_config, device))
    if not engine.engine.runner.core.shares_weights(model.gpt.llama):
        # the engine holds its own copy (another dtype or device): the reference path's is read again from
        # the checkpoint on its first use
        freed = model.gpt.release_llama()
        logger.info("reference Llama weights released until first use (%.0f MiB)", freed / 2**20)
    return _Loaded(model=model, device=device, audio=audio, engine=engine,
                   pipeline=Pipeline(engine, model, audio, stream_config),
                   reference=ReferencePath(model, audio, device))


def _set_coef(model, coef: str) -> None:
    """Upstream's ``coef``: a base16384 string of 100 float32 mel scales for the DVAE and the Decoder."""
    try:
        values = np.frombuffer(b14.decode_from_string(coef), dtype=np.float32).copy()
    except Exception as e:  # noqa: BLE001 - any decoding failure is the caller's malformed string
        raise ValueError(f"malformed coef string: {e}") from None
    for m in (model.dvae, model.decoder):
        if values.size != m.coef.numel():
            raise ValueError(f"coef has {values.size} values, the DVAE needs {m.coef.numel()}")
        m.coef.copy_(torch.from_numpy(values).view_as(m.coef))
