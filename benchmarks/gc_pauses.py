"""Garbage-collector pauses in a long offline generation: the velocity engine runs ``bench``'s 256 requests of
500 tokens (full-size random weights) with the collector as is, after ``freeze_long_lived`` and off, two runs
each, and prints each run's GPT time, every engine step's wall time and tokens, and the collections over 1 ms.

    python benchmarks/gc_pauses.py [--batch 256] [--tokens 500]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from chattts_velocity.bench.config import BenchConfig
from chattts_velocity.bench.measure import Clock
from chattts_velocity.bench.paths import run_velocity
from chattts_velocity.bench.runner import bench_prompt, engine_config, load_model
from chattts_velocity.engine import LLMEngine
from chattts_velocity.gc_freeze import freeze_long_lived


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=500)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = BenchConfig(batches=(args.batch,), tokens=args.tokens, skip_reference=True, device=device.type,
                      json_path=None)
    model = load_model("full", device, 0)
    prompt = bench_prompt(model, args.tokens, device)
    engine = LLMEngine.from_model(model, engine_config(cfg, args.batch, prompt.ids.shape[0] + args.tokens), device)
    clock = Clock(device)
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(on_gc)
    step = engine.step
    steps: list[tuple[float, int]] = []

    def timed_step():
        t0 = time.perf_counter()
        outs = step()
        steps.append((time.perf_counter() - t0, max((o.new_token_ids.shape[0] for o in outs), default=0)))
        return outs

    engine.step = timed_step
    run_velocity(engine, prompt, args.batch, 24, 0, clock)  # warm-up
    for mode in ("collector as is", "freeze_long_lived", "collector off"):
        if mode == "freeze_long_lived":
            freeze_long_lived()
        elif mode == "collector off":
            gc.disable()
        for run in range(2):
            pauses.clear()
            steps.clear()
            gen = run_velocity(engine, prompt, args.batch, args.tokens, 0, clock)
            print(f"{mode}, run {run + 1}: GPT {gen.gpt_s:.3f} s (prefill {gen.prefill_s:.3f} s); steps (ms, tokens):",
                  [(round(s * 1e3, 1), n) for s, n in steps],
                  "; collections over 1 ms (generation, ms):", [(g, round(p * 1e3, 1)) for g, p in pauses if p > 1e-3],
                  f"; all collections {1e3 * sum(p for _, p in pauses):.1f} ms", flush=True)
    gc.enable()


if __name__ == "__main__":
    main()
