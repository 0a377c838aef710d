"""Host timeline of a request's first steps on the bare ``LLMEngine`` (no threads): prefill, the short first
window, the pipelined windows behind it; each ``step`` split into scheduling, launches and the wait.

    python benchmarks/first_window.py [--runs 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from chattts_velocity.bench.stream import StreamBenchConfig, load_chat
from chattts_velocity.engine import Prompt, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    chat = load_chat(StreamBenchConfig(), 8)
    engine = chat.engine.engine
    worker = engine.worker
    marks: list[tuple[str, float]] = []

    def wrap(obj, name):
        original = getattr(obj, name)

        def timed(*a, **kw):
            start = time.perf_counter()
            out = original(*a, **kw)
            marks.append((f"{name} {1e3 * (time.perf_counter() - start):.1f}ms", start))
            return out

        setattr(obj, name, timed)

    for name in ("launch", "launch_next", "collect"):
        wrap(worker, name)
    wrap(engine.scheduler, "schedule")
    ids, _, mask = chat.model.tokenizer.encode(["[Stts][empty_spk]first window probe[Ptts]"], 4)
    for run in range(args.runs):
        marks.clear()
        engine.add_request(f"r{run}", Prompt(ids[0], mask[0]), SamplingParams(seed=run, max_new_tokens=80,
                                                                              min_new_tokens=80))
        start = time.perf_counter()
        reports = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                reports.append((round(1e3 * (time.perf_counter() - start), 1), out.num_generated))
        torch.cuda.synchronize()
        print(f"run {run}: reports (ms, tokens) {reports}")
        print("  calls:", [(round(1e3 * (t - start), 1), label) for label, t in marks[:12]])
    chat.unload()


if __name__ == "__main__":
    main()
