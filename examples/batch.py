"""Many lines to many audio files through ``chattts_velocity.synth``: every line goes through the one shared
engine at once, the output folder is resumable and bad lines are reported, not fatal. The command-line form is
``chattts-velocity synth INPUT -o DIR``.

    python examples/batch.py --out batch_out
    python examples/batch.py --model DIR --device cpu --input lines.jsonl --format flac

Without ``--input`` it speaks a few built-in lines (one with its own seed and file name, and one bad line, to
show how failures are reported). Rerunning with the same ``--out`` skips the lines already written."""

from __future__ import annotations

from chattts_velocity.synth import SynthConfig, synth

from _common import example_parser, load_chat, run

LINES = [
    "The first line of the batch.",
    "Every line becomes its own audio file.",
    {"text": "A JSON line can carry its own settings.", "seed": 7, "file": "custom_name"},
    {"text": "This line is bad: top_p must be in (0, 1].", "top_p": 3},
    "The lines are generated together, not one after another.",
]


def main() -> None:
    ap = example_parser(__doc__, "batch_out")
    ap.add_argument("--input", default=None, help="a text or .jsonl file (default: the built-in lines)")
    ap.add_argument("--format", default="wav", choices=["wav", "flac", "mp3", "ogg"])
    ap.add_argument("--seed", type=int, default=42, help="seed of the lines without their own")
    args = ap.parse_args()

    chat = load_chat(args)
    config = SynthConfig(out_dir=args.out, fmt=args.format, seed=args.seed, random_speaker=True, refine=False,
                         max_new_token=args.max_new_token)
    result = synth(chat, args.input or LINES, config)

    for entry in sorted(result.written, key=lambda e: e["line"]):
        print(f"line {entry['line']}: {entry['file']} ({entry['duration']:.2f} s)")
    for err in result.failed:
        print(f"line {err.lineno} failed: {err.reason}")
    print(f"{len(result.written)} written, {result.skipped} already done, {len(result.failed)} failed; "
          f"{result.audio_seconds:.1f} s of audio in {result.seconds:.1f} s (manifest: {args.out}/manifest.jsonl)")
    chat.unload()


if __name__ == "__main__":
    run(main)
