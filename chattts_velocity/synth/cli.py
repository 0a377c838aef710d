"""``chattts-velocity synth``: the command line over ``plan`` and ``run``."""

from __future__ import annotations

import os
import sys

from .disk import SynthWriteError
from .plan import ERRORS, MANIFEST, SynthConfig, SynthInterrupted, SynthResult, plan
from .run import run


def cli(args, load) -> int:
    """``chattts-velocity synth``: exit 0 when every line is written (or already was), 1 when some failed or a
    file could not be written (one line on stderr naming it), 130 on Ctrl-C; usage errors (missing input,
    unwritable folder, unreadable manifest, bad options) raise ``ValueError`` (exit 2) before ``load()`` loads the
    model, which happens only if there is work."""
    config = SynthConfig(out_dir=args.out_dir, fmt=args.format, seed=args.seed, speaker=args.speaker,
                         random_speaker=args.random_speaker, refine=not args.no_refine, prompt=args.prompt,
                         max_new_token=args.max_new_token, concurrency=args.concurrency)
    job = plan(args.input, config)
    try:
        result = run(load() if job.todo else None, job, config)
    except SynthInterrupted as e:
        print(f"interrupted: {len(e.result.written)} lines written by this run are kept in {config.out_dir} (and "
              f"listed in its {MANIFEST}); run the same command again to resume", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted before any line was written", file=sys.stderr)
        return 130
    except SynthWriteError as e:
        kept = len(e.result.written) if e.result is not None else 0
        print(f"error: {e}; the {kept} lines written before it are kept, run the same command again to resume",
              file=sys.stderr)
        return 1
    print(summary(result, config))
    return 1 if result.failed else 0


def summary(result: SynthResult, config: SynthConfig) -> str:
    """One line: what was written, skipped and failed."""
    text = f"synth: {len(result.written)} lines written"
    if result.written:
        audio = result.audio_seconds
        text += f" ({audio:.1f} s of audio in {result.seconds:.1f} s, {audio / result.seconds:.1f}x real time)"
    text += f", {result.skipped} already done"
    if result.failed:
        return f"{text}, {len(result.failed)} FAILED (listed in {os.path.join(config.out_dir, ERRORS)})"
    return f"{text}, none failed"
