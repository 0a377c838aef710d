"""synth: the output folder on disk. Audio files land whole or not at all, manifest rows are appended whole or cut
off again, and every write failure (disk full, no permission) is a ``SynthWriteError`` naming the file.

The manifest is a record of work done, read row by row, and a line it does not record is simply done again; so a
row that cannot be used (torn by a crash or a full disk, or edited by hand into something other than a JSON object
with a string ``file`` and ``text``, and a valid ``speaker`` where ``random_speaker`` is true) is skipped with a
warning naming the manifest and its row number, and the line it recorded is synthesised again unless another row
records it. Blank rows are ignored. Only a manifest that cannot be read at all is an error (``ValueError``).
Skipped rows are left as they are (a hand-edited file is not rewritten) except a torn last row (no newline), which
is cut off the file before the next append, so that append starts a row of its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tempfile
import uuid

from ..constants import SAMPLE_RATE
from ..text import decode_speaker

logger = logging.getLogger(__name__)
_CHUNK = 1 << 16
"""Bytes read at a time when looking backwards for the manifest's last row."""
_BINARY = getattr(os, "O_BINARY", 0)
"""No newline translation where the OS has it (Windows)."""
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}


class SynthWriteError(OSError):
    """A file of the output folder could not be written: the run stopped there. The lines recorded in the manifest
    before it are kept (``result``, set once the run has stopped), and running again resumes."""

    result = None

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


def write_error(path: str, e: OSError) -> SynthWriteError:
    return SynthWriteError(e.errno, e.strerror or str(e), path)


def check_out_dir(out_dir: str) -> None:
    """Create the folder and make sure a file can be created in it (``ValueError``: a usage error)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".probe.")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"cannot write to the output folder {out_dir!r}: {e}") from None


def write_audio(path: str, wav, container: str, subtype: str) -> None:
    """Encode in memory (an encoder error is the line's), then write under a temporary name in the same folder and
    rename: the file is whole or absent. Writing the bytes here rather than through libsndfile makes a full disk
    an ``OSError`` with its reason instead of libsndfile's "System error."."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, wav, SAMPLE_RATE, format=container, subtype=subtype)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.part")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _BINARY, 0o666)  # 0o666: the umask decides, as for open()
        try:
            _write_all(fd, buf.getbuffer())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        raise


def remove_partial(out_dir: str, files: set[str]) -> None:
    """Remove the temporary files of lines to redo, left by a run killed while writing them."""
    for name in os.listdir(out_dir):
        if name.startswith(".") and name.endswith(".part") and name[1:].rsplit(".", 2)[0] in files:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out_dir, name))


def read_manifest(path: str) -> list[tuple[int, dict]]:
    """The usable entries of a manifest with their row numbers (none if it does not exist); every other non-blank
    row is skipped with a warning. ``ValueError`` if the file exists but cannot be read."""
    entries = []
    try:
        with open(path, "rb") as f:
            for number, row in enumerate(f, 1):
                entry = _entry(row)
                if isinstance(entry, dict):
                    entries.append((number, entry))
                elif entry and row.endswith(b"\n"):
                    logger.warning("%s row %d skipped (%s): it does not count as a line done", path, number, entry)
                elif entry:
                    logger.warning("%s row %d skipped: cut short (%s), as a run stopped while writing it leaves it; "
                                   "it is cut off the file and its line done again", path, number, entry)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ValueError(f"cannot read the manifest {path}: {e.strerror or e}") from None
    return entries


def _entry(row: bytes) -> dict | str:
    """A manifest row's entry, or why it is not one ("" for a blank row)."""
    try:
        text = row.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        return f"not UTF-8: {e.reason} at byte {e.start}"
    if not text.strip():
        return ""
    try:
        entry = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
        return f"not JSON: {e}"
    if not isinstance(entry, dict):
        return f"{_JSON_KINDS[type(entry)]}, not a JSON object"
    for key in ("file", "text"):
        if not isinstance(entry.get(key), str):
            return f"{key!r} is missing" if key not in entry else f"{key!r} is not a string"
    if not isinstance(entry.get("random_speaker", False), bool):
        return "'random_speaker' is not true or false"
    if entry.get("random_speaker"):
        try:
            decode_speaker(entry.get("speaker"))
        except ValueError as e:
            return f"its random 'speaker' is not a speaker string: {e}"
    return entry


class Appender:
    """A JSONL file written row by row without a buffer: a row lands whole, or the part of it that did is cut off
    again, so a later row never glues onto it. ``truncate``: start empty (else append)."""

    def __init__(self, path: str, truncate: bool = False):
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | _BINARY | (os.O_TRUNC if truncate else os.O_APPEND)
        try:
            self.fd = os.open(path, flags, 0o666)
        except OSError as e:
            raise write_error(path, e) from None

    def write(self, row: dict) -> None:
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            _write_all(self.fd, data)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)
            raise write_error(self.path, e) from None

    def close(self) -> None:
        os.close(self.fd)


def open_manifest(path: str) -> Appender:
    """The manifest, opened for appending once its last row, if torn (no newline), is mended: ended with a newline
    if it is a usable entry, else cut off (``read_manifest`` warned about it)."""
    try:
        with contextlib.suppress(FileNotFoundError), open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            start = _last_row_start(f, size)
            if start < size:
                f.seek(start)
                if isinstance(_entry(f.read()), dict):
                    f.write(b"\n")
                else:
                    f.truncate(start)
    except OSError as e:
        raise write_error(path, e) from None
    return Appender(path)


def _last_row_start(f, size: int) -> int:
    """The offset just after the file's last newline (0 if none)."""
    end = size
    while end > 0:
        start = max(0, end - _CHUNK)
        f.seek(start)
        cut = f.read(end - start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
