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

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field

from .config import SAMPLE_RATE
from .params import InferCodeParams, RefineTextParams

FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
           "ogg": ("OGG", "VORBIS")}
"""Output format -> soundfile (libsndfile) container and subtype."""
MANIFEST = "manifest.jsonl"
ERRORS = "errors.jsonl"
_LINE_KEYS = {"text": str, "speaker": str, "seed": int, "temperature": float, "top_p": float, "top_k": int,
              "prompt": str, "refine": bool, "file": str}
"""Keys of a JSONL line and their types (``float`` accepts ints too)."""
_KIND_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
_NULLABLE = {"speaker", "seed", "top_p", "top_k"}
_CODE_FIELDS = {"speaker": "spk_emb", "seed": "manual_seed", "temperature": "temperature", "top_p": "top_P",
                "top_k": "top_K", "prompt": "prompt"}
_STEM = re.compile(r"\w[\w.-]{0,119}")
_DRAIN_S = 60.0
"""After Ctrl-C, how long the lines in flight get to return their (discarded) partial audio."""


@dataclass(frozen=True)
class SynthConfig:
    """A synth run: where the files go and the defaults of every line."""

    out_dir: str
    """Folder of the audio files, ``manifest.jsonl`` and ``errors.jsonl`` (created if absent)."""
    fmt: str = "wav"
    """wav, flac, mp3 or ogg (Vorbis); wav and flac are 16-bit."""
    seed: int | None = None
    """``manual_seed`` of every line without its own ``seed`` (None: random)."""
    speaker: str | None = None
    """Speaker string of every line without its own ``speaker``."""
    random_speaker: bool = False
    """Sample one random speaker for the whole run (a resumed run reuses the manifest's)."""
    refine: bool = True
    """Run the text-refine pass (a line's ``refine`` overrides it)."""
    prompt: str = "[speed_5]"
    """Code prompt of every line without its own ``prompt``."""
    max_new_token: int = 2048
    """Audio tokens per sentence at most."""
    min_new_token: int = 0
    """Audio tokens per sentence at least (EOS is masked before)."""
    concurrency: int | None = None
    """Lines in flight (default: twice the engine's ``max_num_seqs``)."""
    show_progress: bool = True
    """Draw a progress bar on stderr."""

    def __post_init__(self) -> None:
        import soundfile as sf

        if self.fmt not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.fmt!r}")
        if FORMATS[self.fmt][0] not in sf.available_formats():
            raise ValueError(f"this libsndfile ({sf.__libsndfile_version__}) cannot write {self.fmt} (mp3 needs "
                             "libsndfile >= 1.1.0): choose another --format or upgrade soundfile")
        if self.speaker is not None and self.random_speaker:
            raise ValueError("give a speaker or random_speaker, not both")
        if self.concurrency is not None and (not isinstance(self.concurrency, int) or self.concurrency < 1):
            raise ValueError(f"concurrency must be an int >= 1, got {self.concurrency!r}")
        if self.speaker is not None:
            from .text import decode_speaker

            decode_speaker(self.speaker)
        self.line_params(Line(0, "", ""))[0].validate()

    def line_params(self, line: Line, speaker: str | None = None) -> tuple[InferCodeParams, RefineTextParams | None]:
        """The ``infer`` parameters of a line (None: no refine pass); ``speaker`` is the run's speaker."""
        code = InferCodeParams(prompt=self.prompt, spk_emb=speaker or self.speaker, manual_seed=self.seed,
                               max_new_token=self.max_new_token, min_new_token=self.min_new_token, show_tqdm=False)
        code = dataclasses.replace(code, **{_CODE_FIELDS[k]: v for k, v in line.options.items() if k in _CODE_FIELDS})
        refine = RefineTextParams(manual_seed=code.manual_seed, show_tqdm=False)
        return code, refine if line.options.get("refine", self.refine) else None


@dataclass(frozen=True)
class Line:
    """One input line to synthesise."""

    lineno: int
    text: str
    file: str
    """Output file name inside the output folder."""
    options: dict = field(default_factory=dict)
    """The line's own settings (JSONL keys other than ``text`` and ``file``)."""


@dataclass(frozen=True)
class LineError:
    """A line that could not be synthesised, and why."""

    lineno: int
    reason: str


@dataclass
class Plan:
    """What a run will do, worked out before any model is loaded."""

    todo: list[Line]
    errors: list[LineError]
    """Lines that cannot be synthesised (bad JSON, missing text, bad values)."""
    skipped: int
    """Lines already in the manifest with their file."""
    random_speaker: str | None = None
    """The random speaker of the run being resumed."""


@dataclass
class SynthResult:
    """What a run did."""

    written: list[dict]
    """Manifest entries of the lines written by this run."""
    skipped: int
    failed: list[LineError]
    seconds: float
    speaker: str | None
    """The run's speaker (the random one with ``random_speaker``)."""

    @property
    def audio_seconds(self) -> float:
        return sum(entry["duration"] for entry in self.written)


class SynthInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: what was written is kept (``result``); rerunning resumes."""

    def __init__(self, result: SynthResult):
        super().__init__("synth interrupted")
        self.result = result


OnLine = Callable[["dict | LineError"], object]
"""Called on the main thread after each line with its manifest entry or its ``LineError``."""


def synth(chat, source, config: SynthConfig, on_line: OnLine | None = None) -> SynthResult:
    """Synthesise ``source`` (a text or ``.jsonl`` file, or a list of str / dict lines) into ``config.out_dir``."""
    return run(chat, plan(source, config), config, on_line)


# ---------------------------------------------------------------- planning (no model needed)
def plan(source, config: SynthConfig) -> Plan:
    """Parse the input and read the manifest. ``ValueError`` for an unreadable input or an unwritable folder."""
    items = _read(source) if isinstance(source, (str, os.PathLike)) else list(enumerate(source, 1))
    jsonl = isinstance(source, (str, os.PathLike)) and os.fspath(source).lower().endswith(".jsonl")
    _check_out_dir(config.out_dir)
    lines, errors, taken = [], [], {}
    for lineno, item in items:
        try:
            line = _parse(lineno, item, jsonl, config)
            if line is None:
                continue
            if line.file in taken:
                raise ValueError(f"output file {line.file!r} is already used by line {taken[line.file]}")
        except ValueError as e:
            errors.append(LineError(lineno, str(e)))
            continue
        taken[line.file] = lineno
        lines.append(line)
    finished = _read_manifest(os.path.join(config.out_dir, MANIFEST))
    todo = [line for line in lines if not _is_done(line, finished.get(line.file), config.out_dir)]
    reused = next((e["speaker"] for e in finished.values() if e.get("random_speaker")), None)
    return Plan(todo, errors, len(lines) - len(todo), reused)


def _read(path) -> list[tuple[int, str | LineError]]:
    """The file's lines (undecodable ones as errors), numbered from 1."""
    try:
        with open(path, "rb") as f:
            raw = f.read().split(b"\n")
    except OSError as e:
        raise ValueError(f"cannot read the input file: {e}") from None
    items: list[tuple[int, str | LineError]] = []
    for lineno, data in enumerate(raw[:-1] if raw and not raw[-1] else raw, 1):
        try:
            items.append((lineno, data.decode("utf-8").removeprefix("\ufeff").rstrip("\r")))
        except UnicodeDecodeError as e:
            items.append((lineno, LineError(lineno, f"not UTF-8 text ({e.reason} at byte {e.start})")))
    return items


def _parse(lineno: int, item, jsonl: bool, config: SynthConfig) -> Line | None:
    """A line of the input (None for a blank one); ``ValueError`` saying what is wrong with it."""
    if isinstance(item, LineError):
        raise ValueError(item.reason)
    ext = config.fmt
    if isinstance(item, str) and not jsonl:
        return Line(lineno, item.strip(), f"{lineno:06d}.{ext}") if item.strip() else None
    if isinstance(item, str):
        if not item.strip():
            return None
        try:
            item = json.loads(item)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(item, dict):
        raise ValueError(f"expected a JSON object with a 'text' key, got {type(item).__name__}")
    _check_keys(item)
    text, stem = item["text"], item.get("file")
    if not text.strip():
        raise ValueError("'text' is blank")
    if stem is not None and not (_STEM.fullmatch(stem) and not stem.endswith(".")):
        raise ValueError(f"'file' {stem!r} is not a safe file name stem: use letters, digits, '_', '-' and '.' "
                         "(not first or last), at most 120 characters")
    options = {k: v for k, v in item.items() if k not in ("text", "file")}
    line = Line(lineno, text.strip(), f"{stem or format(lineno, '06d')}.{ext}", options)
    code, _ = config.line_params(line)
    code.validate()
    if options.get("speaker") is not None:
        from .text import decode_speaker

        decode_speaker(options["speaker"])
    return line


def _check_keys(item: dict) -> None:
    unknown = sorted(set(item) - set(_LINE_KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}: a line may have {', '.join(_LINE_KEYS)}")
    if "text" not in item:
        raise ValueError("missing 'text'")
    for key, value in item.items():
        kind = _LINE_KEYS[key]
        if value is None and key in _NULLABLE:
            continue
        ok = isinstance(value, (int, float) if kind is float else kind) and (kind is bool or not isinstance(value, bool))
        if not ok:
            raise ValueError(f"{key!r} must be {_KIND_NAMES[kind]}, got {value!r}")


def _check_out_dir(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".probe.")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"cannot write to the output folder {out_dir!r}: {e}") from None


def _read_manifest(path: str) -> dict[str, dict]:
    """File name -> its latest manifest entry (a line cut short by a crash is ignored)."""
    entries = {}
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
        for row in f:
            try:
                entry = json.loads(row)
                entries[entry["file"]] = entry
            except (ValueError, KeyError, TypeError):
                continue
    return entries


def _is_done(line: Line, entry: dict | None, out_dir: str) -> bool:
    return entry is not None and entry.get("text") == line.text and os.path.isfile(os.path.join(out_dir, line.file))


# ---------------------------------------------------------------- running
def run(chat, job: Plan, config: SynthConfig, on_line: OnLine | None = None) -> SynthResult:
    """Synthesise ``job.todo`` with ``chat``'s engine (``chat`` may be None when there is nothing to do);
    ``on_line(entry_or_error)`` is called after each line. Ctrl-C raises ``SynthInterrupted`` once the lines in
    flight were stopped (their audio is discarded)."""
    speaker = _run_speaker(chat, config, job) if job.todo else None
    result = SynthResult([], job.skipped, [], 0.0, speaker)
    start = time.monotonic()
    _remove_partial(config.out_dir, {line.file for line in job.todo})
    try:
        with _Recorder(config, len(job.todo), result) as record:
            for err in job.errors:
                record(err, advance=False)
            if job.todo:
                _run_lines(chat, job.todo, config, speaker, record, on_line)
    except KeyboardInterrupt:
        raise SynthInterrupted(result) from None
    finally:
        result.seconds = time.monotonic() - start
    return result


def _run_lines(chat, lines: list[Line], config: SynthConfig, speaker: str | None, record: _Recorder,
               on_line: OnLine | None) -> None:
    """Every line through ``concurrency`` worker threads; each outcome is recorded as it comes. On any
    exception here (Ctrl-C included) the lines in flight are stopped first, and those already written kept."""
    workers = config.concurrency or 2 * chat.engine.engine.config.max_num_seqs
    pool = ThreadPoolExecutor(min(workers, len(lines)), thread_name_prefix="synth")
    stop = threading.Event()
    futures = [pool.submit(_speak, chat, config, line, speaker, stop) for line in lines]
    pending = set(futures)
    try:
        for fut in as_completed(futures):
            pending.discard(fut)
            record(fut.result())
            if on_line is not None:
                on_line(fut.result())
    except BaseException:
        stop.set()
        _drain(chat, futures)
        for fut in pending:
            if fut.done() and not fut.cancelled() and isinstance(fut.result(), dict):
                record(fut.result())  # written before the stop: kept, so it goes in the manifest
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _run_speaker(chat, config: SynthConfig, job: Plan) -> str | None:
    """The run's speaker, checked against the model before any work."""
    from .text import speaker_vector

    speaker = config.speaker
    if config.random_speaker:
        speaker = job.random_speaker or chat.sample_random_speaker()
    if speaker is not None:
        speaker_vector(speaker, chat.model.config.hidden_size)
    return speaker


def _speak(chat, config: SynthConfig, line: Line, speaker: str | None, stop: threading.Event) -> dict | LineError | None:
    """One line, on a worker thread: its manifest entry once its file is written, a ``LineError``, or None when
    the run was stopped."""
    code, refine = config.line_params(line, speaker)
    try:
        wav = chat.infer(line.text, skip_refine_text=refine is None, params_infer_code=code,
                         params_refine_text=refine)[0]
        if stop.is_set():
            return None
        _write(os.path.join(config.out_dir, line.file), wav, config.fmt)
    except Exception as e:  # noqa: BLE001 - whatever breaks one line is reported and the others go on
        return LineError(line.lineno, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
    return {"line": line.lineno, "text": line.text, "file": line.file, "duration": round(wav.size / SAMPLE_RATE, 6),
            "seed": code.manual_seed, "speaker": code.spk_emb,
            "random_speaker": config.random_speaker and code.spk_emb == speaker and speaker is not None}


def _write(path: str, wav, fmt: str) -> None:
    """Write under a temporary name in the same folder, then rename: the file is whole or absent."""
    import soundfile as sf

    container, subtype = FORMATS[fmt]
    # a fresh random name, created by soundfile (mkstemp would leave the file readable by its owner only)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.part")
    try:
        sf.write(tmp, wav, SAMPLE_RATE, format=container, subtype=subtype)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _remove_partial(out_dir: str, files: set[str]) -> None:
    """Remove the temporary files of lines to redo, left by a run killed while writing them."""
    for name in os.listdir(out_dir):
        if name.startswith(".") and name.endswith(".part") and name[1:].rsplit(".", 2)[0] in files:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out_dir, name))


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
        self.manifest = _append(os.path.join(config.out_dir, MANIFEST))
        self.errors = open(os.path.join(config.out_dir, ERRORS), "w", encoding="utf-8")  # noqa: SIM115
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
            self.result.failed.append(outcome)
            self.errors.write(json.dumps({"line": outcome.lineno, "error": outcome.reason}, ensure_ascii=False) + "\n")
            self.errors.flush()
            self.bar.write(f"line {outcome.lineno}: {outcome.reason}", file=sys.stderr)
        elif outcome is not None:
            self.result.written.append(outcome)
            self.manifest.write(json.dumps(outcome, ensure_ascii=False) + "\n")
            self.manifest.flush()
            self.audio += outcome["duration"]
            self.bar.set_postfix_str(f"{self.audio:.1f} s audio", refresh=False)
        if outcome is not None and advance:
            self.bar.update(1)


def _append(path: str):
    """Open the manifest for appending, after ending a line a crash cut short."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                with open(path, "a", encoding="utf-8") as g:
                    g.write("\n")
    return open(path, "a", encoding="utf-8")  # noqa: SIM115 - the caller closes it


# ---------------------------------------------------------------- command line
def cli(args, load) -> int:
    """``chattts-velocity synth``: exit 0 when every line is written (or already was), 1 when some failed, 130
    on Ctrl-C; usage errors (missing input, unwritable folder, bad options) raise ``ValueError`` (exit 2) before
    ``load()`` loads the model, which happens only if there is work."""
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
