"""Batch text-to-audio (``chattts-velocity synth INPUT -o DIR``): every line of a text or JSONL file becomes one
audio file, all lines through the one shared engine at once.

Each line is exactly ``Chat.infer(text)`` (sentence split, optional refine, the split-mode voice sample), called by
one of ``concurrency`` worker threads: the engine batches the GPT passes of every line in flight and refills a
finished line's slot at once, so there is no per-wave tail; each line's wav is then decoded at its own length, as
``infer`` does (lines of different lengths cannot share a decode call without padding changing their audio).

The output folder is resumable: a file is written under a temporary name and renamed into place, then its entry is
appended (flushed) to ``manifest.jsonl``; a rerun skips every line whose file exists and whose manifest entry has
the same text. Bad lines are reported with their line number (stderr and ``errors.jsonl``) and the rest go on.
"""

from .cli import cli, summary
from .plan import (
           ERRORS,
           FORMATS,
           MANIFEST,
           Line,
           LineError,
           Plan,
           SynthConfig,
           SynthInterrupted,
           SynthResult,
           plan,
)
from .run import run, synth

__all__ = ["ERRORS", "FORMATS", "MANIFEST", "Line", "LineError", "Plan", "SynthConfig", "SynthInterrupted",
           "SynthResult", "cli", "plan", "run", "summary", "synth"]
