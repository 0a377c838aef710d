"""The refine pass's text logits per step at full size on the CPU: the weight-normed head as the module computes
it (the norm of the [21178, 768] weight redone every call) against the same weight materialised once.

    python benchmarks/text_head.py --rows 1 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from chattts_velocity.model.embed import Embed


def per_call_ms(fn, calls: int = 20, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    torch.manual_seed(0)
    embed = Embed(768, 626, 21178, 4).eval()
    with torch.no_grad(), parametrize.cached():
        weight = embed.head_text.weight.detach().clone()
    for rows in args.rows:
        h = torch.randn(rows, 768)
        with torch.inference_mode():
            assert torch.equal(embed.text_logits(h), F.linear(h, weight)), "the materialised head differs"
            every = per_call_ms(lambda h=h: embed.text_logits(h))
            once = per_call_ms(lambda h=h: F.linear(h, weight))
        print(f"rows {rows}: weight norm every call {every:.2f} ms, materialised {once:.2f} ms")


if __name__ == "__main__":
    main()
