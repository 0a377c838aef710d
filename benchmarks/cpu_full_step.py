"""Where a full-size CPU decode step goes: one 32-step window of the velocity engine at batch N under
``torch.profiler`` (the ops with the most self time), and the layers' GEMMs alone with the weight as stored
([N, K], multiplied as ``h @ W.T``) against the same weight stored transposed ([K, N], ``h @ Wt``).

    python benchmarks/cpu_full_step.py --batch 8
    python benchmarks/cpu_full_step.py --batch 8 --size tiny --top 15   (the tiny model: per-op overhead)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from chattts_velocity.bench.runner import load_model
from chattts_velocity.engine import EngineConfig, LLMEngine, Prompt, SamplingParams

SHAPES = {"qkv": (2304, 768), "o": (768, 768), "gate/up": (6144, 768), "down": (768, 3072)}


def per_call_ms(f, n: int = 30) -> float:
    for _ in range(3):
        f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", choices=("full", "tiny"), default="full")
    ap.add_argument("--top", type=int, default=5, help="ops listed, by self time")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(args.size, torch.device("cpu"), seed=0)
    prompt = Prompt(torch.randint(0, min(model.config.num_text_tokens, 20000), (36, 1)).expand(-1, 4), torch.ones(36, dtype=torch.bool))
    engine = LLMEngine.from_model(model, EngineConfig(dtype="float32", max_num_seqs=args.batch, kv_cache_gib=0.5),
                                  "cpu")
    for i in range(args.batch):
        engine.add_request(str(i), prompt, SamplingParams(min_new_tokens=64, max_new_tokens=64, seed=i))
    engine.step()  # prefill
    engine.step()  # the short first window
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.step()  # a 32-step window
        took = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"batch {args.batch}: a 32-step window took {took:.2f} s under the profiler ({1e3 * took / 32:.1f} ms "
          "a step)")
    for e in events[: args.top]:
        print(f"  {e.key:24} {100 * e.self_cpu_time_total / total:5.1f}%  {e.count / 32:6.1f} calls a step  "
              f"{e.self_cpu_time_total / e.count / 1e3:.3f} ms each")
    if args.size == "tiny":
        return
    print("GEMMs alone, ms per call: h @ W.T (as stored) against h @ Wt (stored transposed)")
    for m in sorted({1, args.batch}):
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k)
            wt, h = w.T.contiguous(), torch.randn(m, k)
            stored = per_call_ms(lambda h=h, w=w: h @ w.T)
            transposed = per_call_ms(lambda h=h, wt=wt: h @ wt)
            print(f"  M={m:<3} {name:8} {stored:.3f}  {transposed:.3f}")


if __name__ == "__main__":
    main()
