"""Reference decode: upstream ChatTTS's per-batch loop over transformers' ``LlamaModel``, step for step.

It reproduces upstream exactly, seeding included (the generator is re-seeded with ``manual_seed`` at every step
and samples the whole [B*num_vq, V] matrix at once), so parity with the ``chattts`` package can be proven. It is
the ``use_velocity=False`` path and the baseline of every benchmark; it is deliberately not optimised.

One deliberate deviation: when a sequence samples EOS at the first step under ``manual_seed``, upstream's
generator ends without yielding any result (``next()`` raises ``StopIteration``, ``infer`` fails); here the batch
goes on and that sequence's result is empty.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from .audio.silence import audible
from .model.gpt import ChatGPT, position_ids_from_mask
from .sampling.processors import process_logits
from .text import check_context, decode_prompt, decorate_code_prompts, decorate_text_prompts, speaker_vector

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeSettings:
    """Sampling settings of one reference call (the whole batch shares them, as upstream)."""

    text_mode: bool
    """Refine (text tokens) instead of audio codes."""
    temperature: tuple[float, ...]
    """One per codebook (audio) or one (text)."""
    top_p: float | None
    top_k: int | None
    repetition_penalty: float | None
    max_new_token: int
    min_new_token: int
    eos_id: int
    penalty_row_cap: int | None
    """Upstream's row cap on penalty counts (see ``repetition_penalty``)."""
    manual_seed: int | None = None
    ensure_non_empty: bool = True
    stream_batch: int = 24
    show_tqdm: bool = True


@dataclass
class GenerationOutput:
    """Per sequence: generated ids ([T_i, num_vq] audio, [T_i] text) and the hidden states that produced them."""

    ids: list[torch.Tensor]
    hiddens: list[torch.Tensor]


class _Retry(Exception):
    """An empty result at step 0 without a seed: upstream starts over."""


@torch.inference_mode()
def reference_generate(
    gpt: ChatGPT,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    text_mask: torch.Tensor,
    settings: DecodeSettings,
    spk_id: int | None = None,
    spk_vec: torch.Tensor | None = None,
    stream: bool = False,
    interrupted: Callable[[], bool] = lambda: False,
) -> Iterator[GenerationOutput]:
    """Yield partial outputs every ``stream_batch`` steps when ``stream``, then the final output."""
    emb = gpt.prompt_embeddings(input_ids, text_mask, spk_id, spk_vec)  # [B, T0, H]
    while True:
        try:
            yield from _attempt(gpt, emb, input_ids, attention_mask, settings, stream, interrupted)
            return
        except _Retry:
            logger.warning("regenerate in order to ensure non-empty")


def _attempt(gpt, emb, input_ids, attention_mask, s: DecodeSettings, stream, interrupted):
    B, T0, num_vq = input_ids.shape
    device = input_ids.device
    buf = torch.zeros(B, T0 + s.max_new_token, num_vq, dtype=input_ids.dtype, device=device)
    buf[:, :T0] = input_ids
    mask = torch.ones(B, T0 + s.max_new_token, dtype=torch.bool, device=device)
    mask[:, :T0] = attention_mask.bool()
    rows = B if s.text_mode else B * num_vq
    temperature = torch.tensor(s.temperature, device=device).unsqueeze(0).expand(B, -1).reshape(rows, 1)
    gen = torch.Generator(device=device)
    finish = torch.zeros(B, dtype=torch.bool, device=device)
    end_idx = torch.zeros(B, dtype=torch.long, device=device)
    hiddens: list[torch.Tensor] = []
    cache, stream_iter = None, 0
    pbar = tqdm(total=s.max_new_token, desc="text" if s.text_mode else "code", disable=not s.show_tqdm,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}(max) [{elapsed}, {rate_fmt}{postfix}]")
    T = T0
    for i in range(s.max_new_token):
        step_mask = mask[:, :T]
        if i == 0:
            x, pos, cache_pos = emb, position_ids_from_mask(step_mask), torch.arange(T, device=device)
        else:
            x = gpt.embed.embed_step(buf[:, T - 1 : T], s.text_mode)
            pos = position_ids_from_mask(step_mask)[:, -1:]
            cache_pos = torch.arange(T - 1, T, device=device)
        hidden, cache = gpt.hidden_states(x, step_mask, pos, cache, cache_pos)  # [B, t, H]
        hiddens.append(hidden[:, -1])
        logits, history = _step_logits(gpt, hidden, buf[:, T0:T], s.text_mode)
        logits = process_logits(logits, history, temperature, s.top_p, s.top_k, s.repetition_penalty,
                                i < s.min_new_token, s.eos_id, s.penalty_row_cap)
        scores = torch.softmax(logits, dim=-1)
        g = gen.manual_seed(s.manual_seed) if s.manual_seed is not None else None
        idx = torch.multinomial(scores, num_samples=1, generator=g)  # [rows, 1]
        idx = idx.view(B, 1).expand(B, num_vq) if s.text_mode else idx.view(B, num_vq)
        finish |= idx.eq(s.eos_id).any(1)
        buf[:, T] = idx
        if i == 0 and finish.any():
            logger.warning("unexpected end at index %s", finish.nonzero().flatten().tolist())
            if s.ensure_non_empty and s.manual_seed is None:
                pbar.close()
                raise _Retry
        T += 1
        alive = ~finish
        end_idx += alive.long()
        stream_iter += int(alive.any())
        if stream and stream_iter > 0 and stream_iter % s.stream_batch == 0:
            yield _outputs(buf, T0, end_idx, hiddens, s.text_mode)
        if finish.all() or interrupted():
            break
        pbar.update(1)
    pbar.close()
    if not finish.all():
        if interrupted():
            logger.warning("generation is interrupted")
        else:
            logger.warning("incomplete result. hit max_new_token: %d", s.max_new_token)
    yield _outputs(buf, T0, end_idx, hiddens, s.text_mode)


def _step_logits(gpt: ChatGPT, hidden: torch.Tensor, generated: torch.Tensor, text_mode: bool):
    """Logits of the last position as a [rows, V] matrix and the per-row history of generated ids."""
    # Heads run on every position and then take the last, as upstream does: same GEMM shapes, same bits.
    if text_mode:
        logits = gpt.embed.text_logits(hidden)[:, -1]  # [B, V]
        return logits, generated[:, :, 0]  # [B, L]
    logits = gpt.embed.code_logits(hidden)[:, -1]  # [B, V, num_vq]
    logits = logits.permute(0, 2, 1).reshape(-1, logits.size(1))  # [B*num_vq, V]
    history = generated.permute(0, 2, 1).reshape(logits.size(0), -1)  # [B*num_vq, L]
    return logits, history


def _outputs(buf, T0, end_idx, hiddens, text_mode) -> GenerationOutput:
    stacked = torch.stack(hiddens, 1)  # [B, steps, H]
    n = end_idx.tolist()
    ids = [buf[b, T0 : T0 + n[b]] for b in range(buf.size(0))]
    if text_mode:
        ids = [x[:, 0] for x in ids]
    return GenerationOutput(
        ids=[x.clone() for x in ids],
        hiddens=[stacked[b, : n[b]].clone() for b in range(buf.size(0))],
    )


class ReferencePath:
    """``Chat``'s ``use_velocity=False`` passes: upstream's loop over whole batches (zero-padded wav decode at
    torch's default precision, upstream's re-decoding stream protocol), for parity and as the baseline."""

    def __init__(self, model, audio, device: torch.device):
        self.model, self.audio, self.device = model, audio, device
        self._epoch = itertools.count()
        self._current = next(self._epoch)

    def interrupt(self) -> None:
        """Calls running now stop after their current step and return what they generated."""
        self._current = next(self._epoch)

    @property
    def interrupts(self) -> int:
        """How many times ``interrupt`` was called: a call that sees it change was interrupted."""
        return self._current

    def refine(self, texts: list[str], p) -> list[torch.Tensor]:
        return self.refine_ids(texts, p).ids

    def refine_ids(self, texts: list[str], p) -> GenerationOutput:
        tok = self.model.tokenizer
        settings = _settings(p, text_mode=True, eos_id=tok.eos_token, row_cap=tok.len, temperature=p.temperatures(1))
        return _last(self._generate(decorate_text_prompts(texts, p.prompt), settings, None, None, stream=False))

    def speak(self, texts: list[str], p, use_decoder: bool) -> list[np.ndarray]:
        res = _last(self.infer_code(texts, False, p))
        return list(self.audio.to_wavs(res.hiddens if use_decoder else res.ids, use_decoder, tf32=False))

    def stream(self, texts: list[str], p, use_decoder: bool) -> Iterator[np.ndarray]:
        """Upstream's protocol: re-decode everything at each partial output, hand out up to ``stream_speed``
        new samples, skip the first ``pass_first_n_batches`` outputs, then the rest minus silent columns."""
        length, seen, wavs = 0, 0, None
        for res in self.infer_code(texts, True, p):
            wavs = self.audio.to_wavs(res.hiddens if use_decoder else res.ids, use_decoder, tf32=False)
            seen += 1
            if seen <= p.pass_first_n_batches:
                continue
            end = min(length + p.stream_speed, wavs.shape[1])
            yield wavs[:, length:end]
            length = end
        tail = wavs[:, length:]
        yield tail[:, audible(tail).any(axis=0)]

    def infer_code(self, texts: list[str], stream: bool, p) -> Iterator[GenerationOutput]:
        cfg = self.model.config
        codes = None
        if p.spk_smp is not None:
            codes = decode_prompt(p.spk_smp, num_vq=cfg.num_vq, num_codes=cfg.num_audio_tokens)
        spk = speaker_vector(p.spk_emb, cfg.hidden_size) if p.spk_emb is not None else None
        prompts = decorate_code_prompts(texts, p.prompt, p.txt_smp, p.spk_emb is not None)
        settings = _settings(p, text_mode=False, eos_id=cfg.eos_code, row_cap=cfg.eos_code,
                             temperature=p.temperatures(cfg.num_vq), stream_batch=p.stream_batch)
        return self._generate(prompts, settings, codes, spk, stream)

    def _generate(self, prompts: list[str], settings: DecodeSettings, codes, spk, stream: bool):
        model, dev = self.model, self.device
        input_ids, attention_mask, text_mask = model.tokenizer.encode(prompts, model.config.num_vq, prompt=codes)
        limit = model.config.max_position_embeddings
        check_context(input_ids.shape[1], limit)
        room = limit - input_ids.shape[1]
        if settings.max_new_token > room:
            logger.warning("max_new_token %d capped to %d by the model's context", settings.max_new_token, room)
            settings = dataclasses.replace(settings, max_new_token=room, min_new_token=min(settings.min_new_token, room))
        epoch = self._current
        return reference_generate(
            model.gpt, input_ids.to(dev), attention_mask.to(dev), text_mask.to(dev), settings,
            spk_id=model.tokenizer.spk_emb_ids, spk_vec=spk, stream=stream,
            interrupted=lambda: self._current != epoch,
        )


def _settings(params, text_mode: bool, eos_id: int, row_cap: int, temperature: tuple[float, ...],
              stream_batch: int = 24) -> DecodeSettings:
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
