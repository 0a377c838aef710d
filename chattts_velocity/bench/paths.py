"""The two measured paths, the reference decode loop and the velocity engine, each timed step by step on the
same prompt, plus the wav decode both share."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ..audio import AudioDecoder
from ..engine import LLMEngine, Prompt, SamplingParams
from ..reference import DecodeSettings, reference_generate
from .measure import TTFA_TOKENS, AudioTiming, Clock, GenerationTiming

# Upstream's code-pass defaults, shared by both paths so they sample alike.
TEMPERATURE = 0.3
TOP_P = 0.7
TOP_K = 20
REPETITION_PENALTY = 1.05

_request_ids = itertools.count()


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt, repeated over the batch: ids [T, num_vq], attention mask [T], text mask [T] (bool)."""

    ids: Tensor
    attention_mask: Tensor
    text_mask: Tensor


class _StampedGPT:
    """The reference's ``ChatGPT`` with a clock reading at the start of every forward pass, one per step.

    Not ``stream=True``: its partial outputs re-stack every hidden state so far at each yield (quadratic in
    the steps), which would slow the baseline itself. The reference already waits for the device every step
    (``finish.all()``), so the reading's synchronisation costs it nothing."""

    def __init__(self, gpt, clock: Clock):
        self._gpt = gpt
        self._clock = clock
        self.stamps: list[float] = []

    def __getattr__(self, name: str):
        return getattr(self._gpt, name)

    def hidden_states(self, *args, **kwargs):
        self.stamps.append(self._clock.now())
        return self._gpt.hidden_states(*args, **kwargs)


def run_reference(
    gpt, prompt: BenchPrompt, batch: int, tokens: int, eos_id: int, clock: Clock
) -> GenerationTiming:
    """Upstream's loop over the prompt repeated ``batch`` times, exactly ``tokens`` steps."""
    settings = DecodeSettings(
        text_mode=False,
        temperature=(TEMPERATURE,) * prompt.ids.shape[-1],
        top_p=TOP_P,
        top_k=TOP_K,
        repetition_penalty=REPETITION_PENALTY,
        max_new_token=tokens,
        min_new_token=tokens,
        eos_id=eos_id,
        penalty_row_cap=eos_id,
        manual_seed=None,
        show_tqdm=False,
    )
    ids = prompt.ids.expand(batch, -1, -1).contiguous()  # [B, T, num_vq]
    mask = prompt.attention_mask.expand(batch, -1).contiguous()  # [B, T]
    text_mask = prompt.text_mask.expand(batch, -1).contiguous()  # [B, T]
    stamped = _StampedGPT(gpt, clock)
    start = clock.now()
    out = list(reference_generate(stamped, ids, mask, text_mask, settings))[-1]
    stamps = [s - start for s in stamped.stamps] + [clock.now() - start]  # stamps[k]: k tokens sampled
    return GenerationTiming(
        gpt_s=stamps[-1],
        prefill_s=stamps[1],
        first_chunk_s=stamps[min(TTFA_TOKENS, len(stamps) - 1)],
        decode_steps_s=[b - a for a, b in zip(stamps[1:-1], stamps[2:], strict=True)],
        hiddens=out.hiddens,
    )


def run_velocity(
    engine: LLMEngine, prompt: BenchPrompt, batch: int, tokens: int, seed: int, clock: Clock
) -> GenerationTiming:
    """``batch`` requests submitted at once, each exactly ``tokens`` tokens, stepped until all finish."""
    # on the host, as the pipeline's tokenizer gives them: a prompt on the device costs every request two
    # copies back that wait for the device, which ``chat.infer`` never pays
    request = Prompt(prompt.ids.cpu(), prompt.text_mask.bool().cpu(), None)
    run = next(_request_ids)
    ids = [f"bench-{run}-{i}" for i in range(batch)]
    start = clock.now()
    for i, rid in enumerate(ids):
        params = SamplingParams(
            temperature=(TEMPERATURE,),
            top_p=TOP_P,
            top_k=TOP_K,
            repetition_penalty=REPETITION_PENALTY,
            min_new_tokens=tokens,
            max_new_tokens=tokens,
            seed=seed + i,
        )
        engine.add_request(rid, request, params)
    return _drive(engine, ids, tokens, clock, start)


def _drive(engine: LLMEngine, ids: list[str], tokens: int, clock: Clock, start: float) -> GenerationTiming:
    # Steps are timed on the host without waiting for the device: ``step`` returns host-side tokens, so the
    # work behind them is done, and a sync here would break any overlap of host scheduling with device work.
    counts = dict.fromkeys(ids, 0)
    hiddens: dict[str, Tensor] = {}
    prefill_s = first_chunk_s = None
    decode_steps: list[float] = []
    last = start
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        advanced = max((out.new_token_ids.shape[0] for out in outs), default=0)
        if prefill_s is not None and advanced:  # an engine step may run several decode steps: split it evenly
            decode_steps += [(now - last) / advanced] * advanced
        last = now
        for out in outs:
            counts[out.request_id] = out.num_generated
            if out.finished:
                hiddens[out.request_id] = out.hidden_states
        if prefill_s is None and min(counts.values()) > 0:
            prefill_s = now - start
        if first_chunk_s is None and counts[ids[0]] >= min(TTFA_TOKENS, tokens):
            first_chunk_s = now - start
    return GenerationTiming(
        gpt_s=clock.now() - start,
        prefill_s=prefill_s,
        first_chunk_s=first_chunk_s,
        decode_steps_s=decode_steps,
        hiddens=[hiddens[rid] for rid in ids],
    )


def time_audio(
    decoder: AudioDecoder, hiddens: list[Tensor], decode_batch: int, padded: bool, clock: Clock
) -> AudioTiming:
    """Decode every sequence to a wav, ``decode_batch`` at a time, and the first request's first chunk alone.
    ``padded``: the reference path's decode, as ``use_velocity=False`` runs it (one padded batch per call,
    torch's default precision); else the velocity path's (per length, TF32 on CUDA)."""
    decode = decoder.to_wavs if padded else decoder.to_wav_list
    tf32 = not padded
    with torch.inference_mode():
        start = clock.now()
        for i in range(0, len(hiddens), decode_batch):
            decode(hiddens[i : i + decode_batch], True, tf32)
        decode_s = clock.now() - start
        start = clock.now()
        decode([hiddens[0][:TTFA_TOKENS]], True, tf32)
        prefix_decode_s = clock.now() - start
    return AudioTiming(decode_s=decode_s, prefix_decode_s=prefix_decode_s)
