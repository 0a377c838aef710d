"""synth: running a plan through one shared engine (a pool of worker threads, each line one ``Chat.infer``),
writing each file atomically and recording it in the manifest. A file that cannot be written (disk full, no
permission) stops the run with a ``SynthWriteError`` naming it: the folder's trouble, not the line's, so the lines
after it would fail the same way."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..constants import SAMPLE_RATE
from ..text import speaker_vector
from .disk import Appender, SynthWriteError, open_manifest, remove_partial, write_audio
from .plan import (
    ERRORS,
    FORMATS,
    MANIFEST,
    Line,
    LineError,
    OnLine,
    Plan,
    SynthConfig,
    SynthInterrupted,
    SynthResult,
    plan,
)

_DRAIN_S = 60.0
"""After Ctrl-C, how long the lines in flight get to return their (discarded) partial audio."""


def synth(chat, source, config: SynthConfig, on_line: OnLine | None = None) -> SynthResult:
    """Synthesise ``source`` (a text or ``.jsonl`` file, or a list of str / dict lines) into ``config.out_dir``."""
    return run(chat, plan(source, config), config, on_line)


def run(chat, job: Plan, config: SynthConfig, on_line: OnLine | None = None) -> SynthResult:
    """Synthesise ``job.todo`` with ``chat``'s engine (``chat`` may be None when there is nothing to do);
    ``on_line(entry_or_error)`` is called after each line. Ctrl-C raises ``SynthInterrupted`` once the lines in
    flight were stopped (their audio is discarded); a file that cannot be written raises ``SynthWriteError``
    (its ``result`` set) the same way."""
    speaker = _run_speaker(chat, config, job) if job.todo else None
    result = SynthResult([], job.skipped, [], 0.0, speaker)
    start = time.monotonic()
    remove_partial(config.out_dir, {line.file for line in job.todo})
    try:
        with _Recorder(config, len(job.todo), result) as record:
            for err in job.errors:
                record(err, advance=False)
            if job.todo:
                _run_lines(chat, job.todo, config, speaker, record, on_line)
    except KeyboardInterrupt:
        raise SynthInterrupted(result) from None
    except SynthWriteError as e:
        e.result = result
        raise
    finally:
        result.seconds = time.monotonic() - start
    return result


def _run_lines(chat, lines: list[Line], config: SynthConfig, speaker: str | None, record: _Recorder,
               on_line: OnLine | None) -> None:
    """Every line through ``concurrency`` worker threads; each outcome is recorded as it comes. On any
    exception here (Ctrl-C included) the lines in flight are stopped first, and those already written kept."""
    ctrl_c = threading.Event()
    with _ctrl_c_sets(ctrl_c):
        workers = config.concurrency or 2 * chat.engine.config.max_num_seqs
        pool = ThreadPoolExecutor(min(workers, len(lines)), thread_name_prefix="synth")
        stop, finished = threading.Event(), queue.SimpleQueue()
        futures = [pool.submit(_speak, chat, config, line, speaker, stop) for line in lines]
        pending = set(futures)
        try:
            for fut in futures:
                fut.add_done_callback(finished.put)
            while pending:
                if ctrl_c.is_set():
                    raise KeyboardInterrupt
                try:
                    fut = finished.get(timeout=0.1)
                except queue.Empty:
                    continue
                pending.discard(fut)
                record(fut.result())
                if on_line is not None:
                    on_line(fut.result())
        except BaseException:
            stop.set()
            _drain(chat, futures)
            for fut in pending:
                if fut.done() and not fut.cancelled() and fut.exception() is None and isinstance(fut.result(), dict):
                    record(fut.result())  # written before the stop: kept, so it goes in the manifest
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def _ctrl_c_sets(flag: threading.Event):
    """While the lines run, Ctrl-C (again: any number of times) sets ``flag``, and the loop stops the run,
    instead of raising wherever the main thread happens to be: raised inside the futures' own locking, it can
    leave a future's lock held, and the workers then hang in ``set_result``, and the interpreter's exit with
    them. Off the main thread (no signals there) and where Ctrl-C is ignored, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_speaker(chat, config: SynthConfig, job: Plan) -> str | None:
    """The run's speaker, checked against the model before any work."""
    if config.random_speaker and job.random_speaker is not None:
        try:
            speaker_vector(job.random_speaker, chat.model.config.hidden_size)
        except ValueError as e:
            raise ValueError(f"{os.path.join(config.out_dir, MANIFEST)} row {job.random_speaker_row}: the random "
                             f"speaker of the run being resumed does not fit this model ({e}); choose another "
                             "--out-dir") from None
        return job.random_speaker
    speaker = chat.sample_random_speaker() if config.random_speaker else config.speaker
    if speaker is not None:
        speaker_vector(speaker, chat.model.config.hidden_size)
    return speaker


def _speak(chat, config: SynthConfig, line: Line, speaker: str | None, stop: threading.Event) -> dict | LineError | None:
    """One line, on a worker thread: its manifest entry once its file is written, a ``LineError``, or None when
    the run was stopped; ``SynthWriteError`` when its file cannot be written."""
    code, refine = config.line_params(line, speaker)
    try:
        wav = chat.infer(line.text, skip_refine_text=refine is None, params_infer_code=code,
                         params_refine_text=refine)[0]
        if stop.is_set():
            return None
        write_audio(os.path.join(config.out_dir, line.file), wav, *FORMATS[config.fmt])
    except SynthWriteError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever breaks one line is reported and the others go on
        return LineError(line.lineno, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
    return {"line": line.lineno, "text": line.text, "file": line.file, "duration": round(wav.size / SAMPLE_RATE, 6),
            "seed": code.manual_seed, "speaker": code.spk_emb,
            "random_speaker": config.random_speaker and code.spk_emb == speaker and speaker is not None}


def _drain(chat, futures: list[Future]) -> None:
    """Cancel the lines not started and interrupt the running ones until all returned (bounded)."""
    for fut in futures:
        fut.cancel()
    running = [fut for fut in futures if not fut.done()]
    deadline = time.monotonic() + _DRAIN_S
    while running and time.monotonic() < deadline:
        chat.interrupt()  # again each round: a line between two passes submits its next one after the last call
        running = list(wait(running, timeout=0.2).not_done)


class _Recorder:
    """The run's one writer: manifest and error appends, the progress bar and the result."""

    def __init__(self, config: SynthConfig, total: int, result: SynthResult):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.result, self.audio = result, 0.0
        self.manifest = open_manifest(os.path.join(config.out_dir, MANIFEST))
        try:
            self.errors = Appender(os.path.join(config.out_dir, ERRORS), truncate=True)
        except SynthWriteError:
            self.manifest.close()
            raise
        self.bar = tqdm(total=total, unit="line", desc="synth", disable=not config.show_progress, file=sys.stderr)
        # log records (the engine's warnings) print above the bar instead of through it
        self._logs = logging_redirect_tqdm() if config.show_progress else contextlib.nullcontext()

    def __enter__(self) -> _Recorder:
        self._logs.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._logs.__exit__(*exc)
        self.bar.close()
        self.manifest.close()
        self.errors.close()

    def __call__(self, outcome: dict | LineError | None, advance: bool = True) -> None:
        if isinstance(outcome, LineError):
            self.errors.write({"line": outcome.lineno, "error": outcome.reason})
            self.result.failed.append(outcome)
            self.bar.write(f"line {outcome.lineno}: {outcome.reason}", file=sys.stderr)
        elif outcome is not None:
            self.manifest.write(outcome)  # first: a line counts as written once it is recorded
            self.result.written.append(outcome)
            self.audio += outcome["duration"]
            self.bar.set_postfix_str(f"{self.audio:.1f} s audio", refresh=False)
        if outcome is not None and advance:
            self.bar.update(1)
