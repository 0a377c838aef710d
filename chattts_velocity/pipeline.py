"""The velocity pipeline (``Chat``'s ``use_velocity=True`` path, and what every front runs through its
``EngineClient``): every text becomes its own request in the shared ``AsyncLLMEngine``
(with the call's ``manual_seed``, so a text's output never depends on its neighbours), tokenised and validated
once. Concurrent calls from any number of threads meet in the engine's batches; each gets its own results.

Streaming decodes audio incrementally (``audio.stream``): each chunk of new tokens with a bounded left context
and look-ahead, the chunks of all of a call's live requests in one batched decode, so the work is linear in the
length and the first audio comes after ``first_chunk + lookahead`` tokens."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from .audio import AudioPump, StreamConfig
from .audio.decode import SharedDecode
from .audio.joins import aligned, faded
from .audio.pump import PENDING, take_ready
from .engine import AsyncLLMEngine, FinishReason, Mode, Prompt, RequestOutput, RequestStream, SamplingParams
from .engine.sequence import Sequence
from .params import InferCodeParams, RefineTextParams
from .text import check_context, decode_prompt, decorate_code_prompts, decorate_text_prompts, speaker_vector

__all__ = ["PENDING", "Generated", "JoinedAudio", "Pipeline", "code_prompts", "refined_texts", "sampling_params",
           "take_ready", "text_prompts"]

logger = logging.getLogger(__name__)


@dataclass
class Generated:
    """One request's final output: ids ([T, num_vq] codes or [T] text ids) and hidden states ([T, H] or None)."""

    ids: torch.Tensor
    hidden: torch.Tensor | None


def sampling_params(p: RefineTextParams, mode: Mode, num_vq: int) -> SamplingParams:
    """Engine parameters of a ``Chat`` pass. ``ensure_non_empty`` masks EOS at the first step: the same
    distribution as upstream's resample-until-not-EOS, in one pass (and it also holds with a seed)."""
    min_new = max(p.min_new_token, 1 if p.ensure_non_empty else 0)
    return SamplingParams(
        mode=mode, temperature=p.temperatures(1 if mode is Mode.TEXT else num_vq), top_p=p.top_P, top_k=p.top_K,
        repetition_penalty=p.repetition_penalty, min_new_tokens=min(min_new, p.max_new_token),
        max_new_tokens=p.max_new_token, seed=p.manual_seed, return_hidden_states=mode is Mode.CODE,
    )


AUDIO_ROUND_S = 0.05
"""Default ``AudioPump.round_interval_s``: paced rounds of later chunks leave the engine more of its time and
lower first audio under load (`chattts-velocity bench serve`, rounds at 0 against 50 ms; docs/perf/). A first
chunk is never held back, a later one at most this long, well inside the audio the first chunk already holds."""


class Pipeline:
    """Refine, code and audio passes through one shared engine: prompts, sampling parameters, requests and
    their audio (whole, streamed in [B, n] chunks, or joined into one stream per request)."""

    def __init__(self, engine: AsyncLLMEngine, model, audio, stream_config: StreamConfig):
        self.engine = engine
        self.model = model
        self.audio = audio
        self.stream_config = stream_config
        if audio.cuda_stream is not None:  # a stall's log says whether it still runs work
            engine.device_streams["the wav decode's"] = audio.cuda_stream
        audio.use_graphs(stream_config.window_lengths())  # CUDA only; each graph is captured at first use
        self.decodes = SharedDecode(audio)
        """The wav decode of ``speak``: calls decoding at once share one decode."""
        self.pump = AudioPump(audio, round_interval_s=AUDIO_ROUND_S)
        """Decodes the stream windows of all concurrent calls together, between engine steps (paced: a round
        that decodes only later chunks comes at most every ``pump.round_interval_s``; ``pump.thread``: on a
        thread of its own)."""
        self._live: weakref.WeakSet[RequestStream] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.interrupts = 0
        """How many times ``interrupt`` was called: a call that sees it change was interrupted."""

    def interrupt(self) -> None:
        """Abort every request in flight; each call returns (or streams) what was generated so far."""
        with self._lock:
            self.interrupts += 1
            live = list(self._live)
        for stream in live:
            stream.abort()

    # ---------------------------------------------------------------- passes
    def refine(self, texts: list[str], p: RefineTextParams) -> list[torch.Tensor]:
        """Refined text ids per text."""
        stream = self.submit(self.text_prompts(texts, p), self.text_params(p))
        return [g.ids for g in self._collect(stream, "text", p)]

    def refine_texts(self, texts: list[str], p: RefineTextParams) -> list[str]:
        """The texts after the refine pass (``refined_texts`` of ``refine``'s ids)."""
        return refined_texts(self.model.tokenizer, self.refine(texts, p))

    def codes(self, texts: list[str], p: InferCodeParams) -> list[Generated]:
        """Audio codes and hidden states per text."""
        return self._collect(self.submit(self.code_prompts(texts, p), self.code_params(p)), "code", p)

    def speak(self, texts: list[str], p: InferCodeParams, use_decoder: bool) -> list[np.ndarray]:
        """Full wavs (not yet silence-stripped), each decoded at its own length, together with those of the
        other calls decoding at the time (``decodes``)."""
        with self.decodes.expecting() as expected:
            results = self.codes(texts, p)
            return self.decodes.to_wav_list([g.hidden if use_decoder else g.ids for g in results], use_decoder,
                                            expected)

    def stream(self, texts: list[str], p: InferCodeParams, use_decoder: bool) -> Iterator[np.ndarray]:
        """[B, n] chunks of the texts' audio as it is generated, silence columns dropped as upstream does with
        its last chunk. Rows stay aligned: a chunk ends where the slowest unfinished row's audio ends."""
        stream = self.submit(self.code_prompts(texts, p), self.code_params(p))
        rows: dict[str, list[np.ndarray]] = {rid: [] for rid in stream.request_ids}  # decoded, not yet yielded
        bar = _bar(p, "code")
        try:
            # woken for outputs without audio only where a progress bar moves with them
            with self.pump.open(stream, self.stream_config, use_decoder, every_round=not bar.disable) as feed:
                for delivery in feed:
                    for out in delivery.outputs:
                        _progress(bar, out)
                        _warn_if_cut(out)
                    for rid, samples in delivery.samples.items():
                        rows[rid] += samples
                    chunk = aligned(rows, delivery.done, stream.request_ids)
                    if chunk is not None:
                        yield chunk
        finally:
            bar.close()
            stream.close()

    def stream_joined(self, texts: list[str], p: InferCodeParams, use_decoder: bool = True,
                      in_flight: int = 4) -> JoinedAudio:
        """The texts' audio as one continuous mono float32 stream, in order (a server's long input split into
        sentences): up to ``in_flight`` texts generate at once, the next one is submitted as one finishes, and
        each join is smoothed by a short fade out and in (no gap, no click). Every text is validated now, before
        the iterator is returned (``ValueError`` naming the text)."""
        return self.joined(self.code_prompts(texts, p), self.code_params(p), use_decoder, in_flight)

    def joined(self, prompts: list[Prompt], params: SamplingParams, use_decoder: bool = True,
               in_flight: int = 4) -> JoinedAudio:
        """``stream_joined`` of prompts already built (``code_prompts``), validated again here."""
        return JoinedAudio(self, self.engine.make_sequences(prompts, params), use_decoder, in_flight)

    def feed(self, stream: RequestStream, use_decoder: bool, notify=None):
        """Start turning ``stream``'s outputs into audio (``AudioPump.open``), delivered only with audio or a
        request's end (``Feed.every_round`` off: its readers take only the audio)."""
        return self.pump.open(stream, self.stream_config, use_decoder, notify, every_round=False)

    def samples(self, stream: RequestStream, use_decoder: bool, notify=None, feed=None) -> Iterator[np.ndarray]:
        """One request's audio as it is generated (each chunk decoded once, batched with other calls'). With
        ``notify``, ``PENDING`` instead of waiting (``Feed``). ``feed``: the stream's feed, if already open."""
        (rid,) = stream.request_ids
        with feed or self.feed(stream, use_decoder, notify) as feed:
            for delivery in feed:
                if delivery is PENDING:
                    yield delivery
                    continue
                for out in delivery.outputs:
                    _warn_if_cut(out)
                if samples := delivery.samples.get(rid):
                    yield np.concatenate(samples)

    # ---------------------------------------------------------------- requests
    def code_params(self, p: InferCodeParams) -> SamplingParams:
        """The engine parameters of an audio-code pass under ``p``."""
        return sampling_params(p, Mode.CODE, self.model.config.num_vq)

    def text_params(self, p: RefineTextParams) -> SamplingParams:
        """The engine parameters of a refine pass under ``p``."""
        return sampling_params(p, Mode.TEXT, self.model.config.num_vq)

    def code_prompts(self, texts: list[str], p: InferCodeParams) -> list[Prompt]:
        """The audio-code prompts of ``texts`` (``code_prompts`` for this model)."""
        return code_prompts(self.model.tokenizer, self.model.config, texts, p)

    def text_prompts(self, texts: list[str], p: RefineTextParams) -> list[Prompt]:
        """The refine prompts of ``texts`` (``text_prompts`` for this model)."""
        return text_prompts(self.model.tokenizer, self.model.config, texts, p)

    def submit(self, prompts: list[Prompt], params: SamplingParams) -> RequestStream:
        """Validate and queue ``prompts`` (``ValueError`` naming the first bad one); one stream yields their
        outputs. ``interrupt`` aborts it."""
        return self.track(self.engine.add_requests(prompts, params))

    def track(self, stream: RequestStream) -> RequestStream:
        """Remember a stream in flight, for ``interrupt``."""
        with self._lock:
            self._live.add(stream)
        return stream

    def _collect(self, stream: RequestStream, desc: str, p: RefineTextParams) -> list[Generated]:
        final: dict[str, RequestOutput] = {}
        bar = _bar(p, desc)
        try:
            for out in stream:
                _progress(bar, out)
                if out.finished:
                    _warn_if_cut(out)
                    final[out.request_id] = out
        finally:
            bar.close()
            stream.close()
        return [Generated(final[rid].token_ids, final[rid].hidden_states) for rid in stream.request_ids]


def code_prompts(tokenizer, cfg, texts: list[str], p: InferCodeParams) -> list[Prompt]:
    """The audio-code prompts of ``texts`` under ``p`` (speaker, voice sample, prompt decorations) for a model
    of config ``cfg``: needs only its tokenizer (a server's front prepares requests without the model)."""
    codes = None
    if p.spk_smp is not None:
        codes = decode_prompt(p.spk_smp, num_vq=cfg.num_vq, num_codes=cfg.num_audio_tokens)
    spk = speaker_vector(p.spk_emb, cfg.hidden_size) if p.spk_emb is not None else None
    return tokenized_prompts(tokenizer, cfg, decorate_code_prompts(texts, p.prompt, p.txt_smp, p.spk_emb is not None),
                             codes, spk)


def text_prompts(tokenizer, cfg, texts: list[str], p: RefineTextParams) -> list[Prompt]:
    """The refine prompts of ``texts`` under ``p`` for a model of config ``cfg``."""
    return tokenized_prompts(tokenizer, cfg, decorate_text_prompts(texts, p.prompt), None, None)


def refined_texts(tokenizer, ids: list[torch.Tensor]) -> list[str]:
    """Refine passes' ids as texts; ids from ``[break_0]`` on are dropped, as upstream does."""
    return tokenizer.decode([t[t < tokenizer.break_0_ids] for t in ids])


def tokenized_prompts(tokenizer, cfg, decorated: list[str], codes, spk) -> list[Prompt]:
    """Prompts of already decorated texts, each checked against the model's context."""
    prompts = []
    for text in decorated:
        ids, _, text_mask = tokenizer.encode([text], cfg.num_vq, prompt=codes)
        check_context(ids.shape[1], cfg.max_position_embeddings)
        prompts.append(Prompt(ids[0], text_mask[0], spk))
    return prompts


class JoinedAudio:
    """Iterator of ``Pipeline.stream_joined``'s chunks. ``cancel`` (or ``close``) may be called from any
    thread, even while another thread is inside ``next``: it ends the stream and aborts its requests, without
    touching the generator (which cannot be closed while it runs).

    ``next`` blocks until the next chunk, unless ``on_ready`` gave a callback before the first ``next``: then
    it returns ``PENDING`` (``audio.pump.PENDING``) when no chunk is there yet, and the callback is called from
    the audio pump's thread (the engine's, mostly) whenever one may be (an event loop serves many streams
    without a thread each)."""

    def __init__(self, path: Pipeline, seqs: list[Sequence], use_decoder: bool, in_flight: int):
        self._lock = threading.Lock()
        self._path, self._use_decoder, self._in_flight = path, use_decoder, in_flight
        self._waiting = list(reversed(seqs))  # not submitted yet, the next one last
        self._total = len(seqs)
        self._live: list[RequestStream] = []
        self._first_feed = None  # opened by ``start``, read by the first ``next``
        self._started = False  # by ``start`` or the first ``next``
        self._cancelled = False
        self._notify = None
        self._chunks = self._run()

    def __iter__(self) -> JoinedAudio:
        return self

    def __next__(self) -> np.ndarray:
        return next(self._chunks)

    def on_ready(self, notify) -> None:
        """Make ``next`` non-blocking (see the class); ``notify()`` must be cheap and thread-safe."""
        self._notify = notify

    def start(self) -> None:
        """Submit the first texts now instead of at the first ``next``, and open the first one's audio feed (a
        non-blocking one if ``on_ready`` was given before): the engine starts on them while the caller does
        other work first (a server's event loop sends the headers of a whole burst of requests before any
        body's first ``next``). After the first ``next`` (or a second time) it does nothing."""
        with self._lock:
            if self._started or self._cancelled:
                return
            self._started = True
        if self._fill() and self._live:
            self._first_feed = self._path.feed(self._live[0], self._use_decoder, self._notify)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            live = list(self._live)
        for stream in live:
            stream.close()

    close = cancel

    def _fill(self) -> bool:
        """Submit waiting texts up to ``in_flight`` live ones; False if cancelled."""
        while self._waiting and len(self._live) < self._in_flight:
            with self._lock:
                if self._cancelled:
                    return False
                stream = self._path.track(self._path.engine.submit([self._waiting[-1]]))
                self._waiting.pop()
                self._live.append(stream)
        return True

    def _run(self) -> Iterator[np.ndarray]:
        path, use_decoder = self._path, self._use_decoder
        with self._lock:
            self._started = True  # a ``start`` from now on does nothing
        try:
            while self._waiting or self._live:
                if not self._fill():
                    return
                first = len(self._waiting) + len(self._live) == self._total
                last = not self._waiting and len(self._live) == 1
                feed, self._first_feed = self._first_feed, None
                yield from faded(path.samples(self._live[0], use_decoder, self._notify, feed), first, last)
                with self._lock:
                    done = self._live.pop(0)
                    if self._cancelled:
                        return
                done.close()
        finally:
            self.cancel()


def _warn_if_cut(out: RequestOutput) -> None:
    """Say so when a request stopped at a length limit rather than at EOS, as the reference path does."""
    if out.finish_reason is FinishReason.LENGTH:
        logger.warning("incomplete result: request %s hit its length limit after %d tokens (max_new_token)",
                       out.request_id, out.num_generated)
    elif out.finish_reason is FinishReason.CAPACITY:
        logger.warning("incomplete result: request %s was cut short after %d tokens, before max_new_token: the "
                       "model's context or the engine's KV cache holds no longer sequence; give the engine more "
                       "KV cache (Chat.load's kv_cache_gib or num_kv_blocks) or shorten the text",
                       out.request_id, out.num_generated)


def _bar(p: RefineTextParams, desc: str) -> tqdm:
    return tqdm(total=p.max_new_token, desc=desc, disable=not p.show_tqdm)


def _progress(bar: tqdm, out: RequestOutput) -> None:
    """The bar follows the longest request of the call."""
    if out.num_generated > bar.n:
        bar.update(out.num_generated - bar.n)
