"""One CPU window-sampling step (``WindowSampler``) of 32 rows of 626 ids (batch 8 x 4 codebooks) with ChatTTS's
defaults (temperature 0.3, top-p 0.7, top-k 20, repetition penalty 1.05 over 16 ids), on a new logits array
every call as in the engine (timing one array over and over lets the sorts' branches learn it): the candidate
path, against the whole-vocabulary chain. Unit-scale logits make rows too flat for the few-largest step (the
partition runs); scaled by 10 they are peaked and the few largest settle them.

    python benchmarks/window_sampler.py
"""

from __future__ import annotations

import time

import torch

from chattts_velocity.kernels.sampling import WindowSampler


def main() -> None:
    torch.manual_seed(0)
    rows, vocab, width, calls = 32, 626, 64, 200
    history = torch.randint(0, vocab, (rows, width))
    args = dict(temperature=torch.full((rows, 1), 0.3), top_p=torch.full((rows, 1), 0.7),
                top_k=torch.full((rows,), 20), penalty=torch.full((rows, 1), 1.05), window=torch.full((rows,), 16),
                min_new=torch.zeros(rows, dtype=torch.int64), seed=torch.arange(rows),
                step=torch.zeros(rows, dtype=torch.int64), lane=torch.arange(rows) % 4)
    for scale, name in ((1.0, "unit-scale logits (partition)"), (10.0, "logits x 10 (few largest)")):
        sampler = WindowSampler(**args, eos_id=vocab - 1, vocab=vocab, width=width, num_steps=32)
        logits = [torch.randn(rows, vocab) * scale for _ in range(calls)]
        times = {}
        for path in ("candidates", "chain"):
            sampler.fast = path == "candidates"
            for x in logits[:20]:
                sampler(x, history, 0)
            start = time.perf_counter()
            for x in logits:
                sampler(x, history, 0)
            times[path] = (time.perf_counter() - start) / calls * 1e3
        print(f"{name}: candidates {times['candidates']:.3f} ms a step, chain {times['chain']:.3f} ms")


if __name__ == "__main__":
    main()
