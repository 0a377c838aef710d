"""``chattts-velocity`` command line: ``say`` (text to a wav file) and ``make-checkpoint`` (random weights)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import SAMPLE_RATE


def _say(args: argparse.Namespace) -> int:
    import numpy as np
    import soundfile as sf

    from .chat import Chat

    ext = os.path.splitext(args.output)[1].lower()
    if ext not in (".wav", ".flac", ".ogg"):
        raise ValueError(f"output must end in .wav, .flac or .ogg, got {args.output!r}")
    chat = Chat()
    if args.dummy:
        chat.load(device=args.device, load_format="dummy")
    elif args.model is not None:
        chat.load(source="custom", custom_path=args.model, device=args.device)
    else:
        chat.load(source=args.source, device=args.device)
    speaker = args.speaker
    if speaker is None and args.random_speaker:
        speaker = chat.sample_random_speaker()
    code = Chat.InferCodeParams(spk_emb=speaker, manual_seed=args.seed, prompt=args.prompt,
                                max_new_token=args.max_new_token)
    refine = Chat.RefineTextParams(manual_seed=args.seed)
    wavs = chat.infer(args.text, skip_refine_text=args.no_refine, params_infer_code=code,
                      params_refine_text=refine)
    audio = np.concatenate(wavs) if wavs else np.zeros(0, dtype=np.float32)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    sf.write(args.output, audio, SAMPLE_RATE)
    print(f"wrote {args.output}: {audio.size / SAMPLE_RATE:.2f} s of audio at {SAMPLE_RATE} Hz")
    return 0


def _make_checkpoint(args: argparse.Namespace) -> int:
    from .model.checkpoint import write_checkpoint

    write_checkpoint(args.dir, size=args.size, seed=args.seed)
    print(f"wrote a random {args.size} ChatTTS checkpoint to {args.dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chattts-velocity", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    say = sub.add_parser("say", help="synthesise text to an audio file")
    say.add_argument("text", help="text to speak (sentences are split and batched as ChatTTS does)")
    say.add_argument("-o", "--output", default="out.wav", help="output file (.wav, .flac, .ogg)")
    src = say.add_mutually_exclusive_group()
    src.add_argument("--model", help="a folder with the upstream asset/ layout (default: 2Noise/ChatTTS from the "
                                     "Hugging Face cache, downloaded if absent)")
    src.add_argument("--dummy", action="store_true", help="full-size random weights (offline; output is noise)")
    say.add_argument("--source", default="huggingface", choices=["huggingface", "local"],
                     help="where to find the real weights when --model is not given")
    say.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    say.add_argument("--seed", type=int, default=None, help="manual_seed for reproducible output")
    spk = say.add_mutually_exclusive_group()
    spk.add_argument("--speaker", default=None, help="a speaker string (from sample_random_speaker)")
    spk.add_argument("--random-speaker", action="store_true", help="sample a random speaker")
    say.add_argument("--prompt", default="[speed_5]", help="code prompt, e.g. [speed_5]")
    say.add_argument("--max-new-token", type=int, default=2048, help="audio tokens per sentence at most")
    say.add_argument("--no-refine", action="store_true", help="skip the text-refine pass")
    say.set_defaults(func=_say)

    mk = sub.add_parser("make-checkpoint", help="write a random checkpoint in the upstream file layout")
    mk.add_argument("dir", help="output folder (asset/ is created inside)")
    mk.add_argument("--size", default="tiny", choices=["tiny", "full"], help="tiny (tests) or full (real shapes)")
    mk.add_argument("--seed", type=int, default=0, help="random seed")
    mk.set_defaults(func=_make_checkpoint)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .model.loader import ModelNotFoundError

    try:
        return args.func(args)
    except (ModelNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
