"""Batch text-to-audio (``chattts-velocity synth INPUT -o DIR``): every line of a text or JSONL file becomes one
audio file, all lines through the one shared engine at once.

Each line is exactly ``Chat.infer(text)`` (sentence split, optional refine, the split-mode voice sample), called by
one of ``concurrency`` worker threads: the engine batches the GPT passes of every line in flight and refills a
finished line's slot at once, so there is no per-wave tail; each line's wav is then decoded at its own length, as
``infer`` does (lines of different lengths cannot share a decode call without padding changing their audio).

The output folder is resumable: a file is written under a temporary name and renamed into place, then its entry is
appended (written through) to ``manifest.jsonl``; a rerun skips every line whose file exists and whose manifest
entry has the same text. Bad lines are reported with their line number (stderr and ``errors.jsonl``) and the rest
go on.

A hostile disk or a hand-edited manifest (``disk``): the manifest is read row by row, and a row that is not a usable
entry (torn by a crash or a full disk, not UTF-8, not JSON, not an object, without a string ``file`` and ``text``,
a random-speaker row without a valid speaker) is skipped with a warning naming the manifest and the row number, and
its line is synthesised again; blank rows are ignored. A torn last row is cut off the file before the next append.
Only a manifest that cannot be read at all, or a resumed random speaker that does not fit the model, stops the run
(an error naming the manifest, and the row). A file that cannot be written (audio, manifest or ``errors.jsonl``:
disk full, no permission) stops the run with ``SynthWriteError`` naming the file and the reason; the lines recorded
before it stay recorded.
"""

from .cli import cli, summary
from .disk import SynthWriteError
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
           "SynthResult", "SynthWriteError", "cli", "plan", "run", "summary", "synth"]
