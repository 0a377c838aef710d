"""What a lone request's prefill step costs on a warm engine (the first token of a stream): the host's wall
time of ``LLMEngine.step()`` against the device's time for it (CUDA events), for a few prompt lengths, and the
host-side operators that take the time (``torch.profiler``, CPU self time).

    python benchmarks/prefill_trace.py [--lengths 40 100 200] [--runs 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from chattts_velocity.engine import EngineConfig, LLMEngine, Prompt, SamplingParams
from chattts_velocity.model.loader import ModelLoader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[40, 100, 200])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    model = ModelLoader(torch.device("cuda"), "dummy").load(None)
    t = time.perf_counter()
    engine = LLMEngine.from_model(model, EngineConfig(dtype=args.dtype, kv_cache_gib=4), "cuda")
    print(f"engine built in {time.perf_counter() - t:.1f} s (CUDA graphs captured)")
    params = SamplingParams(min_new_tokens=8, max_new_tokens=8)
    counter = iter(range(10**9))

    def prefill(length: int) -> tuple[float, float]:
        g = torch.Generator().manual_seed(next(counter))  # a fresh prompt: no prefix cache hit
        ids = torch.randint(0, 20000, (length, 1), generator=g).expand(-1, 4)
        rid = f"r{next(counter)}"
        engine.add_request(rid, Prompt(ids, torch.ones(length, dtype=torch.bool)), params)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        outs = engine.step()
        end.record()
        wall = time.perf_counter() - t
        torch.cuda.synchronize()
        assert outs and outs[0].num_generated == 1, "the step was not the request's prefill"
        engine.abort_request(rid, report=False)
        return wall * 1e3, start.elapsed_time(end)

    for length in args.lengths:
        for _ in range(3):
            prefill(length)
        walls, devs = zip(*(prefill(length) for _ in range(args.runs)), strict=True)
        print(f"prompt {length:4d} tokens: step wall {statistics.median(walls):.2f} ms (host), events "
              f"{statistics.median(devs):.2f} ms, median of {args.runs}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(args.lengths[0])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))


if __name__ == "__main__":
    main()
