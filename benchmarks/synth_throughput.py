"""Batch synthesis throughput: ``synth`` over N lines (all through the shared engine at once) against a loop of
one ``chat.infer([line])`` per line (each line written to a wav file in both), on the same loaded ``Chat``.
Every line is forced to exactly ``--max-new-token`` audio tokens (min = max), so both do the same work.

    python benchmarks/synth_throughput.py --model DIR --lines 200 --max-new-token 32 --device cpu
    python benchmarks/synth_throughput.py --dummy --lines 512 --max-new-token 300 --device cuda

Prints a table and a JSON object: lines/s, audio seconds per second and the speed-up of synth over the loop."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import soundfile as sf

from chattts_velocity import Chat
from chattts_velocity.cli import synth_max_num_seqs
from chattts_velocity.constants import SAMPLE_RATE
from chattts_velocity.synth import SynthConfig, synth


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint folder (upstream asset/ layout)")
    src.add_argument("--dummy", action="store_true", help="full-size random weights")
    ap.add_argument("--lines", type=int, default=200, help="lines synthesised by synth (default: 200)")
    ap.add_argument("--loop-lines", type=int, default=None,
                    help="lines of the infer loop (default: --lines; fewer saves time, rates are per line)")
    ap.add_argument("--max-new-token", type=int, default=32, help="audio tokens per line, exactly (default: 32)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--engine-dtype", default="float32", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--concurrency", type=int, default=None, help="synth: lines in flight (default: its own)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="engine: sequences decoded together (default: the synth command's, by device)")
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args()


def load(args) -> Chat:
    chat = Chat()
    seqs = args.max_num_seqs or synth_max_num_seqs(args.device)
    if args.dummy:
        chat.load(load_format="dummy", device=args.device, engine_dtype=args.engine_dtype, max_num_seqs=seqs)
    else:
        chat.load(source="custom", custom_path=args.model, device=args.device, engine_dtype=args.engine_dtype,
                  max_num_seqs=seqs)
    return chat


DIGITS = "zero one two three four five six seven eight nine".split()


def text(i: int) -> str:
    """A different sentence per line (in words: ChatTTS's normaliser drops digits)."""
    number = " ".join(DIGITS[int(d)] for d in str(i))
    return f"line {number} of the benchmark, the quick brown fox jumps over the lazy dog"


def code_params(tokens: int) -> Chat.InferCodeParams:
    return Chat.InferCodeParams(manual_seed=0, max_new_token=tokens, min_new_token=tokens, show_tqdm=False)


def time_loop(chat: Chat, n: int, tokens: int, out_dir: str) -> tuple[float, float]:
    """Seconds and audio seconds of one ``infer`` call per line, each written to a wav."""
    audio = 0.0
    start = time.perf_counter()
    for i in range(n):
        wav = chat.infer([text(i)], skip_refine_text=True, params_infer_code=code_params(tokens))[0]
        sf.write(os.path.join(out_dir, f"{i:06d}.wav"), wav, SAMPLE_RATE)
        audio += wav.size / SAMPLE_RATE
    return time.perf_counter() - start, audio


def time_synth(chat: Chat, n: int, tokens: int, out_dir: str, concurrency: int | None) -> tuple[float, float]:
    config = SynthConfig(out_dir=out_dir, seed=0, refine=False, max_new_token=tokens, min_new_token=tokens,
                         concurrency=concurrency, show_progress=False)
    start = time.perf_counter()
    result = synth(chat, [text(i) for i in range(n)], config)
    seconds = time.perf_counter() - start
    if result.failed or len(result.written) != n:
        raise RuntimeError(f"synth wrote {len(result.written)} of {n} lines: {result.failed[:3]}")
    return seconds, result.audio_seconds


def main() -> None:
    args = parse_args()
    chat = load(args)
    loop_lines = args.loop_lines or args.lines
    with tempfile.TemporaryDirectory() as tmp:
        time_loop(chat, 2, args.max_new_token, tmp)  # warm-up (CUDA graphs, allocator, first-call costs)
        synth_s, synth_audio = time_synth(chat, args.lines, args.max_new_token, os.path.join(tmp, "synth"),
                                          args.concurrency)
        os.makedirs(os.path.join(tmp, "loop"))
        loop_s, loop_audio = time_loop(chat, loop_lines, args.max_new_token, os.path.join(tmp, "loop"))
    rows = {"loop": (loop_lines, loop_s, loop_audio), "synth": (args.lines, synth_s, synth_audio)}
    results = {name: {"lines": n, "seconds": round(s, 3), "lines_per_s": round(n / s, 2),
                      "audio_s_per_s": round(a / s, 2)} for name, (n, s, a) in rows.items()}
    speedup = results["synth"]["lines_per_s"] / results["loop"]["lines_per_s"]
    report = {"device": str(chat.device), "model": args.model or "dummy", "max_new_token": args.max_new_token,
              "max_num_seqs": chat.engine.config.max_num_seqs,
              "engine_dtype": args.engine_dtype, "results": results, "speedup": round(speedup, 2)}
    print(f"{'':6} {'lines':>6} {'seconds':>8} {'lines/s':>8} {'audio s/s':>10}")
    for name, r in results.items():
        print(f"{name:6} {r['lines']:>6} {r['seconds']:>8.2f} {r['lines_per_s']:>8.2f} {r['audio_s_per_s']:>10.2f}")
    print(f"synth over loop: {speedup:.2f}x")
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    chat.unload()


if __name__ == "__main__":
    main()
