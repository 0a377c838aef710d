"""The refine (text) pass alone, velocity engine against the reference path, in one run: N texts refined at
once, every one forced to the same number of text tokens (min_new_token = max_new_token), median of the
repeats; tokens per second over all texts and the speed-up.

    python benchmarks/refine_speed.py --size tiny --device cpu --batch 1 8 --tokens 100
    python benchmarks/refine_speed.py --size full --device cuda --batch 1 8 64 --tokens 200   (dummy weights)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from chattts_velocity import Chat
from chattts_velocity.model.checkpoint import write_checkpoint

TEXT = "the quick brown fox jumps over the lazy dog and keeps on running"


def timed(chat: Chat, path, batch: int, tokens: int, seed: int) -> float:
    params = Chat.RefineTextParams(min_new_token=tokens, max_new_token=tokens, manual_seed=seed, show_tqdm=False)
    if chat.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    path.refine([f"{TEXT} {i}" for i in range(batch)], params)
    if chat.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine-dtype", default=None, help="default: float16 on CUDA, float32 on CPU")
    args = ap.parse_args()
    dtype = args.engine_dtype or ("float16" if args.device.startswith("cuda") else "float32")
    chat = Chat()
    with tempfile.TemporaryDirectory() as root:
        if args.size == "full":
            chat.load(load_format="dummy", device=args.device, engine_dtype=dtype, max_num_seqs=max(args.batch))
        else:
            write_checkpoint(root, "tiny", seed=0)
            chat.load(source="custom", custom_path=root, device=args.device, engine_dtype=dtype,
                      max_num_seqs=max(args.batch))
    print(f"refine pass, {args.size} model on {args.device}, engine {dtype}, {args.tokens} text tokens a text")
    print("| batch | reference tokens/s | velocity tokens/s | speed-up |")
    print("|---|---|---|---|")
    for batch in args.batch:
        rates = {}
        for name, path in (("reference", chat.reference), ("velocity", chat.pipeline)):
            timed(chat, path, batch, min(args.tokens, 16), 0)  # warm-up
            runs = [timed(chat, path, batch, args.tokens, seed) for seed in range(args.repeats)]
            rates[name] = batch * args.tokens / statistics.median(runs)
        print(f"| {batch} | {rates['reference']:,.0f} | {rates['velocity']:,.0f} | "
              f"{rates['velocity'] / rates['reference']:.1f}× |", flush=True)
    chat.unload()


if __name__ == "__main__":
    main()
