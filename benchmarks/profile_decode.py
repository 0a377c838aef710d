"""Profile one multi-step decode window of the velocity engine (CUDA graphs off so kernels are visible)."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from chattts_velocity.engine import EngineConfig, LLMEngine, Prompt, SamplingParams
from chattts_velocity.model.loader import ModelLoader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    model = ModelLoader(torch.device("cuda"), "dummy").load(None)
    ids = torch.randint(0, 20000, (30, 1)).expand(-1, 4)
    prompt = Prompt(ids, torch.ones(30, dtype=torch.bool))
    engine = LLMEngine.from_model(model, EngineConfig(dtype=args.dtype, max_num_seqs=args.batch, kv_cache_gib=4,
                                                      enforce_eager=True), "cuda")
    for i in range(args.batch):
        engine.add_request(str(i), prompt, SamplingParams(min_new_tokens=100, max_new_tokens=100))
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
