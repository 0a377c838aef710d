"""Where a CUDA-graphed decode step's time goes: every kernel of ``--steps`` graph replays at a fixed batch,
from the CUDA profiler (kernels inside graphs included), against the replays' wall time from CUDA events.
Prints each kernel's launches per step and mean duration, the kernels' busy time per step and the idle
remainder (launch gaps between dependent kernels), so a change to the step can be judged kernel by kernel.

    python benchmarks/step_trace.py [--batch 1] [--context 286] [--steps 64]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from chattts_velocity.engine import EngineConfig, LLMEngine, Prompt, SamplingParams
from chattts_velocity.model.loader import ModelLoader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=286, help="prompt length the replayed steps attend over")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    model = ModelLoader(torch.device("cuda"), "dummy").load(None)
    ids = torch.randint(0, 20000, (args.context, 1)).expand(-1, 4)
    prompt = Prompt(ids, torch.ones(args.context, dtype=torch.bool))
    engine = LLMEngine.from_model(model, EngineConfig(dtype=args.dtype, max_num_seqs=max(args.batch, 1),
                                                      max_num_batched_tokens=max(2048, args.batch * args.context),
                                                      kv_cache_gib=12), "cuda")
    params = SamplingParams(min_new_tokens=4 * args.steps, max_new_tokens=4 * args.steps)
    for i in range(args.batch):
        engine.add_request(str(i), prompt, params)
    for _ in range(args.batch):  # the prefill: one step, as the batch's prompts fit the token budget
        if len(engine.scheduler.running) == args.batch:
            break
        engine.step()
    assert len(engine.scheduler.running) == args.batch, "the prefill did not admit the whole batch"
    decoder = engine.runner.decoder
    seqs = [seq for seq in engine.scheduler.running]
    decoder.run(seqs, 1)  # load the batch into the graph's buffers
    graph = decoder.graphs[decoder._bucket(len(seqs)), False]
    torch.cuda.synchronize()

    def replays(n: int) -> None:
        for i in range(n):
            if i % decoder.max_steps == 0:  # a window's output rows are max_steps long
                decoder.state.step_out.zero_()
            graph.replay()

    walls = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays(1)
        start.record()
        replays(args.steps - 1)
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end) * 1e3 / (args.steps - 1))
    wall = sorted(walls)[len(walls) // 2]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replays(args.steps)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            kernels[ev.name].append(ev.device_time_total)
    busy = sum(sum(v) for v in kernels.values()) / args.steps
    launches = sum(len(v) for v in kernels.values()) / args.steps
    print(f"batch {args.batch}, context {args.context}: {wall:.1f} us per replayed step (median of 5 x "
          f"{args.steps - 1}); kernels busy {busy:.1f} us in {launches:.0f} launches per step; idle "
          f"{wall - busy:.1f} us ({(wall - busy) / max(launches, 1):.2f} us per launch)")
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    print(f"{'us/step':>8} {'per step':>8} {'mean us':>8}  kernel")
    for name, times in rows:
        print(f"{sum(times) / args.steps:8.1f} {len(times) / args.steps:8.1f} {sum(times) / len(times):8.2f}  "
              f"{name[:110]}")


if __name__ == "__main__":
    main()
