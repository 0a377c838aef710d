"""Quick GPU timing of the velocity engine's decode (full-size random weights): ms per decode step."""

from __future__ import annotations

import argparse
import time

import torch

from chattts_velocity.engine import EngineConfig, LLMEngine, Prompt, SamplingParams
from chattts_velocity.model.loader import ModelLoader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--window", type=int, nargs="+", default=[8])
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    model = ModelLoader(torch.device("cuda"), "dummy").load(None)
    ids = torch.randint(0, 20000, (30, 1)).expand(-1, 4)
    prompt = Prompt(ids, torch.ones(30, dtype=torch.bool))
    for window in args.window:
        cfg = EngineConfig(dtype=args.dtype, max_num_seqs=max(args.batch), kv_cache_gib=8, num_decode_steps=window,
                           enforce_eager=args.eager)
        t0 = time.perf_counter()
        engine = LLMEngine.from_model(model, cfg, "cuda")
        print(f"engine init {time.perf_counter() - t0:.1f}s window={window}")
        for b in args.batch:
            for rep in range(2):
                p = SamplingParams(min_new_tokens=args.tokens, max_new_tokens=args.tokens)
                for i in range(b):
                    engine.add_request(f"{b}-{rep}-{i}", prompt, p)
                engine.step()  # prefill
                torch.cuda.synchronize()
                t = time.perf_counter()
                steps = 0
                while engine.has_unfinished_requests():
                    engine.step()
                    steps += 1
                torch.cuda.synchronize()
                dt = time.perf_counter() - t
            ms = dt / (args.tokens - 1) * 1e3
            print(f"batch {b:4d} window {window}: {ms:.3f} ms/step, {b * (args.tokens - 1) / dt:.0f} tok/s, "
                  f"{b * (args.tokens - 1) / dt / 46.875:.0f}x RT, engine calls {steps}")


if __name__ == "__main__":
    main()
