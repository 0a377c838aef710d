"""Time the reference decode (``use_velocity=False``) against upstream ChatTTS 0.2.5 on the same full-size
random checkpoint: ms per decode step at a given batch, forced to a fixed number of steps. Also checks that both
produce the same codes on this device. Usage: python benchmarks/reference_step.py [--device cuda] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, repeats):
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)

    import ChatTTS

    from chattts_velocity import Chat
    from chattts_velocity.constants import SAMPLE_RATE, SAMPLES_PER_TOKEN
    from chattts_velocity.model.checkpoint import write_checkpoint

    root = tempfile.mkdtemp()
    write_checkpoint(root, "full", seed=0)
    ours = Chat()
    ours.load(source="custom", custom_path=root, device=device)
    up = ChatTTS.Chat()
    assert up._load(device=device, **{k: os.path.join(root, v) for k, v in asdict(up.config.path).items()})

    spk = ours.sample_random_speaker()
    kw = dict(spk_emb=spk, manual_seed=1, max_new_token=args.steps, min_new_token=args.steps, show_tqdm=False)
    print(f"device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} steps={args.steps}")
    print("| batch | impl | ms/step | x real time | codes equal |")
    for b in args.batch:
        texts = ["Hello world, this is a benchmark sentence."] * b
        t_up, ref = _time(lambda texts=texts: next(up._infer_code(list(texts), False, device, True, up.InferCodeParams(**kw))),
                          device, args.repeats)
        t_ours, out = _time(lambda texts=texts: list(ours.reference.infer_code(list(texts), False, ours.InferCodeParams(**kw)))[-1],
                            device, args.repeats)
        same = all(torch.equal(a.cpu(), r.cpu()) for a, r in zip(out.ids, ref.ids, strict=True))
        audio_s = args.steps * SAMPLES_PER_TOKEN / SAMPLE_RATE * b
        for name, t in (("upstream chattts 0.2.5", t_up), ("reference (use_velocity=False)", t_ours)):
            print(f"| {b} | {name} | {1000 * t / args.steps:.2f} | {audio_s / t:.2f} | {same} |")


if __name__ == "__main__":
    main()
