"""The engine without ``Chat.infer``: build a private ``LLMEngine`` over the loaded model, add requests (each
with its own prompt, speaker and sampling settings), call ``step()`` until every request finished, then decode
the hidden states to wavs. This is what ``Chat.infer`` does through the shared engine thread; driving it by hand
(on one thread) is for experiments: custom scheduling, your own batching, reading tokens as they come.

    python examples/engine_direct.py
    python examples/engine_direct.py --model DIR --device cpu --out engine_out --max-new-token 300

Writes OUT/engine_0.wav, OUT/engine_1.wav, ... and prints the engine's statistics."""

from __future__ import annotations

import os
import time

import soundfile as sf

from chattts_velocity.engine import EngineConfig, LLMEngine, Prompt, SamplingParams
from chattts_velocity.text import decorate_code_prompts, speaker_vector

from _common import example_parser, load_chat, run

TEXTS = ["The engine runs every request in one batch.", "Each request has its own seed and speaker.",
         "Tokens arrive step by step."]
MAX_STEPS = 100_000
"""A bound on the step loop (every step advances every running request by at least one token)."""


def prompts(chat, texts: list[str], speakers: list[str]) -> list[Prompt]:
    """Code-pass prompts ``[Stts][spk_emb][speed_5]{text}[Ptts]``, tokenised, with their speaker vectors."""
    model = chat.model
    out = []
    for text, spk in zip(texts, speakers, strict=True):
        normalised = chat.normalizer(text)
        (decorated,) = decorate_code_prompts([normalised], "[speed_5]", None, True)
        ids, _, text_mask = model.tokenizer.encode([decorated], model.config.num_vq)  # [1, T, num_vq], [1, T]
        out.append(Prompt(ids[0], text_mask[0], speaker_vector(spk, model.config.hidden_size)))
    return out


def main() -> None:
    ap = example_parser(__doc__, "engine_out", "audio tokens per request at most")
    args = ap.parse_args()

    chat = load_chat(args)
    engine = LLMEngine.from_model(chat.model, EngineConfig(max_num_seqs=8, kv_cache_gib=1.0), chat.device)
    speakers = [chat.sample_random_speaker() for _ in TEXTS]
    for i, prompt in enumerate(prompts(chat, TEXTS, speakers)):
        params = SamplingParams(seed=i, temperature=0.3, max_new_tokens=args.max_new_token)
        engine.add_request(f"line-{i}", prompt, params)

    start, finished, steps = time.perf_counter(), {}, 0
    while engine.has_unfinished_requests() and steps < MAX_STEPS:
        for out in engine.step():  # new codes [n, 4] and hidden states [n, H] of every request that advanced
            if out.finished:
                finished[out.request_id] = out
        steps += 1
    seconds = time.perf_counter() - start

    os.makedirs(args.out, exist_ok=True)
    results = [finished[f"line-{i}"] for i in range(len(TEXTS))]
    wavs = chat.audio.to_wav_list([r.hidden_states for r in results], use_decoder=True)
    for i, (r, wav) in enumerate(zip(results, wavs, strict=True)):
        path = os.path.join(args.out, f"engine_{i}.wav")
        sf.write(path, wav, 24000)
        print(f"{path}: {r.num_generated} tokens ({r.finish_reason.value}), {wav.size / 24000:.2f} s")
    stats = engine.stats()
    print(f"{steps} engine steps in {seconds:.2f} s, {stats.num_generated_tokens} tokens generated, "
          f"largest batch {stats.max_batch_size}")
    chat.unload()


if __name__ == "__main__":
    run(main)
