"""The ``use_velocity=True`` decode of ``Chat``: ChatTTS prompts as engine requests, engine steps as the same
``GenerationOutput`` stream the reference loop yields (partial outputs every ``stream_batch`` steps, then the
final one), so ``Chat`` treats both paths alike."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from .engine import LLMEngine, Mode, Prompt, SamplingParams
from .reference import DecodeSettings, GenerationOutput

logger = logging.getLogger(__name__)
_calls = itertools.count()


def sampling_params(s: DecodeSettings) -> SamplingParams:
    """Engine parameters of a ``Chat`` decode. ``ensure_non_empty`` masks EOS at the first step: the same
    distribution as upstream's resample-until-not-EOS, in one pass (and it also holds with a seed)."""
    min_new = max(s.min_new_token, 1 if s.ensure_non_empty else 0)
    return SamplingParams(
        mode=Mode.TEXT if s.text_mode else Mode.CODE, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        repetition_penalty=s.repetition_penalty, min_new_tokens=min(min_new, s.max_new_token),
        max_new_tokens=s.max_new_token, seed=s.manual_seed, return_hidden_states=not s.text_mode,
    )


def velocity_generate(engine: LLMEngine, tokenizer, prompts: list[str], settings: DecodeSettings,
                      prompt_codes: torch.Tensor | None, spk_vec: torch.Tensor | None, stream: bool,
                      interrupted: Callable[[], bool] = lambda: False) -> Iterator[GenerationOutput]:
    """Every prompt is its own request with the call's seed, so a text's output never depends on its
    neighbours. Validates and queues them all before the first step (the generator starts right away)."""
    num_vq = engine.model_config.num_vq
    params = sampling_params(settings)
    requests = []
    for text in prompts:
        ids, _, text_mask = tokenizer.encode([text], num_vq, prompt=prompt_codes)
        requests.append(Prompt(ids[0], text_mask[0], spk_vec))
    for prompt in requests:
        engine.validate_request(prompt, params)
    call = next(_calls)
    ids = [f"chat-{call}-{i}" for i in range(len(requests))]
    for rid, prompt in zip(ids, requests, strict=True):
        engine.add_request(rid, prompt, params)
    return _drive(engine, ids, settings, stream, interrupted)


def _drive(engine: LLMEngine, ids: list[str], s: DecodeSettings, stream: bool,
           interrupted: Callable[[], bool]) -> Iterator[GenerationOutput]:
    tokens: dict[str, list[torch.Tensor]] = {rid: [] for rid in ids}
    hiddens: dict[str, list[torch.Tensor]] = {rid: [] for rid in ids}
    pending = set(ids)
    done = 0  # steps of the longest sequence so far (the engine may decode several per call)
    bar = tqdm(total=s.max_new_token, desc="text" if s.text_mode else "code", disable=not s.show_tqdm)
    try:
        while pending:
            if interrupted():
                logger.warning("generation is interrupted")
                break
            longest = done
            for out in engine.step():
                if out.request_id not in pending:
                    continue
                tokens[out.request_id].append(out.new_token_ids)
                if out.new_hidden_states is not None:
                    hiddens[out.request_id].append(out.new_hidden_states)
                longest = max(longest, out.num_generated)
                if out.finished:
                    pending.discard(out.request_id)
            bar.update(longest - done)
            if stream and longest // s.stream_batch > done // s.stream_batch:
                yield _collect(ids, tokens, hiddens)
            done = longest
    finally:
        bar.close()
        for rid in pending:  # interrupted, or the consumer stopped early
            engine.abort_request(rid, report=False)
    yield _collect(ids, tokens, hiddens)


def _collect(ids, tokens, hiddens) -> GenerationOutput:
    """Everything generated so far (every request reports at least once: when it finishes, or is aborted)."""
    return GenerationOutput(ids=[torch.cat(tokens[rid]) if tokens[rid] else torch.empty(0, dtype=torch.int64)
                                 for rid in ids],
                            hiddens=[torch.cat(hiddens[rid]) if hiddens[rid] else torch.empty(0) for rid in ids])
