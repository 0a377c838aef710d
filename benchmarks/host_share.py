"""Where the engine thread's time goes while a batch decodes (the bench's batch run: full-size random weights,
every sequence forced to --tokens tokens): waiting for the device inside ``collect`` against the host
work around it (queueing the next window, reading tokens back, handing them to the scheduler, building the
reports). If the waits fill most of the wall time, the steps are device-bound and the graph replays are the
floor; if the host work does, it is the host.

    python benchmarks/host_share.py --batch 1 64 256 --tokens 500
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from chattts_velocity.bench import paths
from chattts_velocity.bench.config import BenchConfig
from chattts_velocity.bench.runner import bench_prompt, engine_config, load_model
from chattts_velocity.engine import LLMEngine, Prompt, SamplingParams


def timed(totals: dict, name: str, fn):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return call


def _waits(fn, totals: dict, counts: dict, name: str):
    def call(self):
        start = time.perf_counter()
        fn(self)
        totals[name] += time.perf_counter() - start
        counts[name] += 1
    call.original = fn
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--tokens", type=int, default=500)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model("full", device, seed=0)
    bench = bench_prompt(model, args.tokens, device)
    prompt = Prompt(bench.ids, bench.text_mask.bool(), None)
    for batch in args.batch:
        config = BenchConfig(batches=(batch,), tokens=args.tokens)
        engine = LLMEngine.from_model(model, engine_config(config, batch, bench.ids.shape[0] + args.tokens), device)
        params = SamplingParams(temperature=(paths.TEMPERATURE,), top_p=paths.TOP_P, top_k=paths.TOP_K,
                                repetition_penalty=paths.REPETITION_PENALTY, min_new_tokens=args.tokens,
                                max_new_tokens=args.tokens, seed=0)
        for warm in (True, False):
            totals: dict[str, float] = defaultdict(float)
            counts: dict[str, int] = defaultdict(int)
            worker, sched = engine.worker, engine.scheduler
            originals = {}
            if not warm:
                for obj, name in ((worker, "launch"), (worker, "launch_next"), (worker, "collect"),
                                  (sched, "schedule"), (sched, "accept"), (engine, "_output")):
                    originals[obj, name] = getattr(obj, name)
                    setattr(obj, name, timed(totals, name, originals[obj, name]))
                syncs = {torch.cuda.Event: "device wait (window)", torch.cuda.Stream: "device wait (reports)"}
                for cls, name in syncs.items():
                    cls.synchronize = _waits(cls.synchronize, totals, counts, name)
            for i in range(batch):
                engine.add_request(f"{warm}-{i}", prompt, params)
            start = time.perf_counter()
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            wall = time.perf_counter() - start
            for (obj, name), fn in originals.items():
                setattr(obj, name, fn)
            if warm:
                continue
            for cls in syncs:
                cls.synchronize = cls.synchronize.original
            print(f"batch {batch}: {wall * 1e3:.0f} ms for {args.tokens} tokens ({wall / args.tokens * 1e3:.3f} ms a "
                  f"token), {steps} engine steps, waits {dict(counts)}")
            for name, value in sorted(totals.items(), key=lambda kv: -kv[1]):
                print(f"  {name:16} {value * 1e3:8.1f} ms  ({100 * value / wall:4.1f}% of the wall)")
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
