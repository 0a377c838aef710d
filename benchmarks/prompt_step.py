"""What a prompt step costs while others decode, as under the speech server: ``--running`` sequences decoding,
then ``--new`` requests of the server's kind (a speaker, the same text, so the prefix cache holds all but the
prompt's last tokens) prefilled in one step, again and again. Prints the step's median wall time and a cProfile
of those steps (host time by function).

    python benchmarks/prompt_step.py [--model DIR | --dummy] [--device cuda] [--running 64] [--new 16]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from chattts_velocity import Chat

TEXT = "Streaming speech for many users at once, chunk by chunk, as soon as it is generated."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint folder (default: --dummy full-size weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    chat = Chat()
    load = dict(source="custom", custom_path=args.model) if args.model else dict(load_format="dummy")
    chat.load(device=args.device, engine_dtype="float16" if args.device.startswith("cuda") else "float32",
              max_num_seqs=1024, max_window_tokens=2048, **load)
    llm, path = chat.engine.engine, chat._velocity
    spk = chat.sample_random_speaker()
    counter = iter(range(10**9))

    def add(n: int, tokens: int) -> list[str]:
        p = chat.InferCodeParams(spk_emb=spk, max_new_token=tokens, min_new_token=tokens, show_tqdm=False)
        prompts = path._code_prompts(chat._prepare_texts(TEXT, True, None, True, True), p)
        params = path._code_params(p)
        rids = []
        for _ in range(n):
            rid = f"r{next(counter)}"
            llm.add_request(rid, prompts[0], params.__class__(**{**params.__dict__, "seed": next(counter)}))
            rids.append(rid)
        return rids

    add(args.running, 100_000)
    while any(g.seq.num_generated < 20 for g in llm.requests.values()):
        llm.step()
    walls, prof = [], cProfile.Profile()
    for run in range(args.runs + 3):
        rids = add(args.new, 8)
        if llm._window is not None:  # a queued decode window first (as the server would)
            llm.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        if run >= 3:
            prof.enable()
        outs = llm.step()
        prof.disable()
        wall = time.perf_counter() - t
        assert sum(1 for o in outs if o.request_id in rids and o.num_generated == 1) == args.new, "not a prompt step"
        if run >= 3:
            walls.append(wall * 1e3)
        for rid in rids:
            llm.abort_request(rid, report=False)
        llm.step()  # a decode window of the running ones between prompt steps
    print(f"prompt step of {args.new} new beside {args.running} running: {statistics.median(walls):.2f} ms median "
          f"wall (min {min(walls):.2f}, max {max(walls):.2f}) over {args.runs}")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())
    chat.unload()


if __name__ == "__main__":
    main()
