"""PagedAttention's promise, measured: KV waste at peak and how many concurrent 1,000-token streams a fixed KV
budget serves.

The budget is given in GiB of the full-size model's fp16 KV cache (20 layers x 2 x 768 values per token: 0.94
MiB per 16-token block); the engine runs with exactly that many blocks, on the tiny checkpoint (block
accounting does not depend on the model's width, only its speed does), with more 1,000-token requests than
fit. Every step it records the sequences running, the tokens they hold and the KV slots allocated to them.
Reported: streams near their full length at once, peak concurrency, preemptions, waste at peak (allocated slots not holding a token), and the same
budget under a contiguous per-request cache of the model's full context (2,048 positions, as a static
Hugging Face cache reserves), for comparison.

    python benchmarks/kv_capacity.py --gib 1 --tokens 1000 --requests 24
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

FULL_LAYERS, FULL_KV_WIDTH, FULL_CONTEXT = 20, 768, 2048


def block_bytes(block_size: int, dtype_bytes: int = 2) -> int:
    return 2 * FULL_LAYERS * FULL_KV_WIDTH * block_size * dtype_bytes


def run(gib: float, tokens: int, requests: int, block_size: int, seed: int) -> dict:
    import torch

    from chattts_velocity import Chat
    from chattts_velocity.engine import EngineConfig, LLMEngine, Mode, Prompt, SamplingParams
    from chattts_velocity.model.checkpoint import write_checkpoint
    from chattts_velocity.text import decorate_code_prompts

    torch.manual_seed(seed)
    blocks = int(gib * 2**30 // block_bytes(block_size))
    chat = Chat()
    with tempfile.TemporaryDirectory() as root:
        write_checkpoint(root, "tiny", seed=seed)
        chat.load(source="custom", custom_path=root, device="cpu", num_kv_blocks=16)  # the model only
    model = chat.model
    chat.unload()
    engine = LLMEngine.from_model(model, EngineConfig(num_kv_blocks=blocks, block_size=block_size,
                                                      max_num_seqs=requests, enable_prefix_caching=False))
    for i in range(requests):
        (text,) = decorate_code_prompts([f"Request number {i} of the capacity test."], "[speed_5]", None, False)
        ids, _, mask = model.tokenizer.encode([text], model.config.num_vq)
        params = SamplingParams(mode=Mode.CODE, max_new_tokens=tokens, min_new_tokens=tokens, seed=i)
        engine.add_request(f"r{i}", Prompt(ids[0], mask[0]), params)
    prompt_len = len(ids[0])
    near_full = prompt_len + tokens - 2 * EngineConfig().num_decode_steps
    peak = dict(running=0, tokens=0, slots=0)
    samples, full_at_once, start = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        held = sum(s.num_computed_tokens for s in running)  # tokens whose K/V are in the cache
        slots = sum(len(s.block_table) for s in running) * block_size
        samples.append((len(running), held, slots))
        full_at_once = max(full_at_once, sum(s.num_computed_tokens >= near_full for s in running))
        if held > peak["tokens"]:
            peak = dict(running=len(running), tokens=held, slots=slots)
    per_stream_blocks = -(-(prompt_len + tokens) // block_size)
    stats = engine.stats()
    waste = [1 - h / s for _, h, s in samples if s]
    return dict(
        gib=gib, block_size=block_size, kv_blocks=blocks, tokens_per_stream=tokens, prompt_tokens=prompt_len,
        requests=requests, peak_running=max(r for r, _, _ in samples), long_streams_at_once=full_at_once, peak_tokens=peak["tokens"],
        peak_slots=peak["slots"], waste_at_peak=1 - peak["tokens"] / peak["slots"],
        waste_mean=sum(waste) / len(waste), preemptions=stats.num_preemptions,
        streams_fit_paged=blocks // per_stream_blocks,
        streams_fit_contiguous=int(gib * 2**30 // (block_bytes(1) * FULL_CONTEXT)),
        wall_s=time.perf_counter() - start,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="KV budget, GiB of the full-size fp16 cache")
    p.add_argument("--tokens", type=int, default=1000, help="audio tokens per stream")
    p.add_argument("--requests", type=int, default=24, help="requests submitted at once (more than fit)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    r = run(a.gib, a.tokens, a.requests, a.block_size, a.seed)
    print(json.dumps(r, indent=2))
    print(f"\n{r['gib']} GiB = {r['kv_blocks']} blocks of {r['block_size']} tokens: {r['long_streams_at_once']} streams "
          f"near their full {r['tokens_per_stream']} tokens ran at once ({r['peak_running']} running at the peak; paged: {r['streams_fit_paged']} fit exactly, a "
          f"contiguous {FULL_CONTEXT}-position cache per request fits {r['streams_fit_contiguous']}); "
          f"waste at peak {100 * r['waste_at_peak']:.2f}% of allocated slots, mean {100 * r['waste_mean']:.2f}%; "
          f"{r['preemptions']} preemptions")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
