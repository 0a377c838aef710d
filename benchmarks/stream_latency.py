"""Where a stream's first audio goes: one streaming ``Chat.infer`` at a time on full-size random weights,
with the engine's own timestamps (queued, first token, first audio) and the time each window decode takes
in the consumer, and a window decode timed alone.

    python benchmarks/stream_latency.py [--runs 3] [--tokens 200]
"""

from __future__ import annotations

import argparse
import time

import torch

from chattts_velocity.bench.stream import TEXT, StreamBenchConfig, load_bench_chat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    chat = load_bench_chat(StreamBenchConfig(), 8)
    pump = chat.pipeline.pump
    decodes: list[tuple[float, float, int]] = []
    original = pump.decode

    def timed(windows, use_decoder):
        start = time.perf_counter()
        out = original(windows, use_decoder)
        decodes.append((start, time.perf_counter(), len(windows)))
        return out

    pump.decode = timed
    reports: list[tuple[float, int]] = []  # engine outputs: (time, tokens generated so far)
    dispatch = chat.engine._dispatch

    def logged(outputs):
        reports.extend((time.perf_counter(), out.num_generated) for out in outputs)
        return dispatch(outputs)

    chat.engine._dispatch = logged
    p = chat.InferCodeParams(manual_seed=0, max_new_token=args.tokens, min_new_token=args.tokens, show_tqdm=False)
    for run in range(args.runs + 1):
        decodes.clear()
        reports.clear()
        start = time.perf_counter()
        arrivals = []
        for chunk in chat.infer([TEXT], stream=True, skip_refine_text=True, split_text=False, params_infer_code=p):
            arrivals.append((time.perf_counter() - start, chunk.shape[1]))
        times = list(chat.engine.stats().requests.values())[-1]
        base = times.queued
        label = "warm-up" if run == 0 else f"run {run}"
        print(f"{label}: first token {1e3 * (times.first_token - base):.1f} ms, first audio "
              f"{1e3 * (times.first_audio - base):.1f} ms, finished {1e3 * (times.finished - base):.1f} ms; "
              f"call -> first chunk {1e3 * arrivals[0][0]:.1f} ms, {len(arrivals)} chunks")
        print("  engine outputs (ms, tokens):", [(round(1e3 * (t - start), 1), n) for t, n in reports[:8]])
        print("  decodes (start ms, took ms, windows):",
              [(round(1e3 * (s - start), 1), round(1e3 * (e - s), 1), n) for s, e, n in decodes[:6]])
    hidden = torch.randn(16, chat.model.config.hidden_size, device=chat.device)
    for label, tf32 in (("tf32", True), ("fp32", False)):
        for _ in range(3):
            chat.audio.to_wavs([hidden], True, tf32)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            chat.audio.to_wavs([hidden], True, tf32)
        print(f"16-token window decode alone ({label}): {1e2 * (time.perf_counter() - start):.2f} ms")
    chat.unload()


if __name__ == "__main__":
    main()
