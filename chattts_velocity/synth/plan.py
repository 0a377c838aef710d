"""synth: its configuration and results, and the plan of a run: the input read and checked line by line, the
output folder checked, the lines already done found in the manifest (no model needed; ``disk`` says which
manifest rows count)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..params import InferCodeParams, RefineTextParams
from ..text import decode_speaker
from .disk import check_out_dir, read_manifest

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
    random_speaker_row: int = 0
    """The manifest row ``random_speaker`` was read from."""


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


def plan(source, config: SynthConfig) -> Plan:
    """Parse the input and read the manifest (its unusable rows skipped with a warning). ``ValueError`` for an
    unreadable input or manifest, or an unwritable folder."""
    items = _read(source) if isinstance(source, (str, os.PathLike)) else list(enumerate(source, 1))
    jsonl = isinstance(source, (str, os.PathLike)) and os.fspath(source).lower().endswith(".jsonl")
    check_out_dir(config.out_dir)
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
    rows = read_manifest(os.path.join(config.out_dir, MANIFEST))
    finished = {entry["file"]: entry for _, entry in rows}
    todo = [line for line in lines if not _is_done(line, finished.get(line.file), config.out_dir)]
    row, reused = next(((n, e["speaker"]) for n, e in rows if e.get("random_speaker")), (0, None))
    return Plan(todo, errors, len(lines) - len(todo), reused, row)


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
        except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
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


def _is_done(line: Line, entry: dict | None, out_dir: str) -> bool:
    return entry is not None and entry.get("text") == line.text and os.path.isfile(os.path.join(out_dir, line.file))
