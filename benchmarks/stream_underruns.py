"""Underruns and first audio of in-process streams, the audio pump's scheduling switched off and on, in one run.

On one model (full-size random weights, as ``chattts-velocity bench stream`` loads them), N threads each stream
one request of ``--tokens`` tokens, all started together, at each level of ``--streams``; every level runs each
variant in turn (``--repeats`` rounds, alternating, so drift hits every variant alike):

- ``before``: paced rounds with only first and last windows in between (``AudioPump(deadlines=False,
  safe_start=False)``, the pump as it was);
- ``deadlines``: later chunks decoded when their listener would otherwise run dry, first audio ahead of a
  round's other windows, full rounds put off while a request waits for its first audio;
- ``deadlines+start``: that, and first audio held until it outlasts the wait for the next chunk (the default).

Only a load more than twice any before it in the process meets a pump that has not served its like
(``audio.deadlines.BURST_CHUNKS``): at such a level, the first variant of its first round alone.

Per level and variant (medians over the rounds; underruns: the most): first audio p50/p95, underruns (playback
started at the first chunk would stall), the start delay that never stalls p50/p95, audio seconds per second.

    python benchmarks/stream_underruns.py                      # 1, 64, 256 streams of 500 tokens
    python benchmarks/stream_underruns.py --streams 256 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json

from chattts_velocity.bench.stream import StreamBenchConfig, load_bench_chat, summarize, velocity_streams

VARIANTS = {
    "before": dict(deadlines=False, safe_start=False),
    "deadlines": dict(deadlines=True, safe_start=False),
    "deadlines+start": dict(deadlines=True, safe_start=True),
}
KEYS = ("ttfa_p50_ms", "ttfa_p95_ms", "start_delay_p50_ms", "start_delay_p95_ms", "audio_s_per_s")


def run(chat, levels: list[int], tokens: int, repeats: int) -> list[dict]:
    pump, rows = chat.pipeline.pump, []
    for n in levels:
        runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for _ in range(repeats):
            for name, switches in VARIANTS.items():
                pump.deadlines, pump.safe_start = switches["deadlines"], switches["safe_start"]
                runs[name].append(summarize(velocity_streams(chat, n, tokens)))
        for name, got in runs.items():
            row = {k: sorted(r[k] for r in got)[len(got) // 2] for k in KEYS}
            rows.append(dict(streams=n, variant=name, underruns=max(r["underruns"] for r in got), **row))
        print_rows(rows[-len(VARIANTS):])
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(f"| {r['streams']} | {r['variant']} | {r['ttfa_p50_ms']:.1f} / {r['ttfa_p95_ms']:.1f} | "
              f"{r['underruns']} | {r['start_delay_p50_ms']:.1f} / {r['start_delay_p95_ms']:.1f} | "
              f"{r['audio_s_per_s']:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--size", choices=["full", "tiny"], default="full")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = StreamBenchConfig(streams=tuple(args.streams), tokens=args.tokens, size=args.size, device=args.device,
                            json_path=None)
    chat = load_bench_chat(cfg, max(args.streams))
    try:
        chat.audio.use_graphs(chat.pipeline.stream_config.window_lengths(), capture=True)
        for n in sorted({1, 8, min(64, max(args.streams))}):  # warm-up: kernels, prefill graphs, audio shapes
            velocity_streams(chat, n, 64)
        print(f"{args.tokens} tokens per stream, median of {args.repeats} rounds (variants alternating)")
        print("| streams | variant | first audio p50 / p95 ms | underruns | start delay p50 / p95 ms | audio s/s |")
        print("|---|---|---|---|---|---|")
        rows = run(chat, args.streams, args.tokens, args.repeats)
    finally:
        chat.unload()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(tokens=args.tokens, repeats=args.repeats, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
