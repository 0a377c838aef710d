"""Where decode time goes (full-size random weights, float16, CUDA graphs): the engine's steady state (three
pipelined windows, host work included) against one window's graph replays alone, timed with CUDA events.

The engine is discarded after its batch is measured: the bare replays advance the device state past what the
scheduler reserved, so their KV writes are not meaningful.
"""

from __future__ import annotations

import argparse
import time

import torch

from chattts_velocity.engine import EngineConfig, LLMEngine, Prompt, SamplingParams
from chattts_velocity.model.loader import ModelLoader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=31, help="tokens per sequence before the measured window")
    args = ap.parse_args()
    model = ModelLoader(torch.device("cuda"), "dummy").load(None)
    prompt = Prompt(torch.randint(0, 20000, (30, 1)).expand(-1, 4), torch.ones(30, dtype=torch.bool))
    for b in args.batch:
        engine = LLMEngine.from_model(model, EngineConfig(dtype="float16", max_num_seqs=b, kv_cache_gib=8,
                                                          max_num_batched_tokens=8192), "cuda")
        dec, window = engine.worker.runner.decoder, engine.config.num_decode_steps
        params = SamplingParams(temperature=(0.3,), top_p=0.7, top_k=20, repetition_penalty=1.05,
                                min_new_tokens=args.context + 6 * window, max_new_tokens=args.context + 6 * window)
        for i in range(b):
            engine.add_request(f"{b}-{i}", prompt, params)
        while min(len(g.seq) for g in engine.requests.values()) < args.context:
            engine.step()
        engine.step()  # the pipeline fills: from here on a window is always queued behind the one being read
        t0 = time.perf_counter()
        for _ in range(3):
            engine.step()
        step_ms = (time.perf_counter() - t0) * 1e3 / 3
        torch.cuda.synchronize()

        seqs = [g.seq for g in engine.requests.values()]
        bucket = dec._bucket(len(seqs))
        t0 = time.perf_counter()
        dec._load(seqs, bucket, dec.num_vq)
        torch.cuda.synchronize()
        load_ms = (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(window):
            dec.graphs[bucket, False].replay()
        end.record()
        end.synchronize()
        gpu_ms = start.elapsed_time(end)
        print(f"batch {b}: engine {step_ms:.2f} ms per {window}-step window ({step_ms / window:.3f}/step); "
              f"graph replays alone {gpu_ms:.2f} ms ({gpu_ms / window:.3f}/step); loading a window's inputs "
              f"from scratch {load_ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
