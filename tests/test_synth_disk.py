"""``chattts-velocity synth`` on a hostile disk and a hand-edited manifest: a torn last row is skipped, reported
and cut off, every other unusable row is skipped with its row number and its line redone, and a file that cannot
be written (disk full, a size limit) stops the run with one line naming it, exit 1, what was recorded kept."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import subprocess
import sys

import pytest
import torch
from test_synth import TOKENS, audio_files, config, manifest, spelled, write_lines

from chattts_velocity import cli
from chattts_velocity.synth import ERRORS, MANIFEST, synth
from chattts_velocity.text import encode_speaker

ENOSPC = os.strerror(errno.ENOSPC)


class FullDisk:
    """``os.write`` as on a disk that fills: writes to the files ``match`` picks go through ``allowed`` times, then
    fail with ENOSPC (the first failing call lands ``partial`` bytes first, as a write cut short does)."""

    def __init__(self, monkeypatch, match, allowed: int, partial: int = 0):
        self.real, self.match, self.allowed, self.partial = os.write, match, allowed, partial
        self.calls = 0
        monkeypatch.setattr(os, "write", self)

    def __call__(self, fd: int, data) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if not self.match(target):
            return self.real(fd, data)
        self.calls += 1
        if self.calls <= self.allowed:
            return self.real(fd, data)
        if self.partial:
            n, self.partial = self.partial, 0
            return self.real(fd, bytes(data[:n]))
        raise OSError(errno.ENOSPC, ENOSPC)


def run_cli(monkeypatch, chat, *argv: str) -> int:
    """``chattts-velocity synth ARGV`` in this process, ``chat`` as the model it loads."""
    monkeypatch.setattr(cli, "load_chat", lambda *a, **k: chat)
    return cli.main(["synth", *argv, "--dummy", "--no-refine", "--max-new-token", str(TOKENS)])


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err and "System error" not in err, err
    return [line for line in err.splitlines() if line.startswith("error")]


def warned_rows(caplog, path: str) -> dict[int, str]:
    """Row number -> warning, of the warnings about the manifest ``path``."""
    rows = {}
    for record in caplog.records:
        found = re.match(rf"{re.escape(path)} row (\d+) ", record.getMessage())
        if record.levelname == "WARNING" and found:
            rows[int(found.group(1))] = record.getMessage()
    return rows


def resumed_lines(out) -> list[int]:
    return sorted(e["line"] for e in manifest(out))


def test_a_row_torn_inside_a_utf8_character_is_reported_cut_off_and_its_line_redone(chat, tmp_path, monkeypatch,
                                                                                   caplog, capsys):
    write_lines(tmp_path / "in.txt", [f"line {spelled(i)} to speak" for i in range(1, 7)])
    out = tmp_path / "out"
    first = synth(chat, str(tmp_path / "in.txt"), config(out, random_speaker=True))
    path = str(out / MANIFEST)
    data = open(path, "rb").read()
    last = data.rstrip(b"\n").rsplit(b"\n", 1)[1]
    start = len(data) - len(last) - 1
    cut = start + next(i for i, b in enumerate(last) if b >= 0xC0) + 1  # after the first byte of a speaker character
    with open(path, "r+b") as f:  # the disk filled in the middle of the row (its audio file was written)
        f.truncate(cut)

    assert run_cli(monkeypatch, chat, str(tmp_path / "in.txt"), "-o", str(out), "--random-speaker") == 0

    warned = warned_rows(caplog, path)
    assert list(warned) == [6] and "cut short" in warned[6] and "not UTF-8" in warned[6]
    assert "1 lines written" in capsys.readouterr().out
    rows = open(path, "rb").read().decode("utf-8").splitlines()  # strict: no torn bytes left behind
    assert len(rows) == 6 and resumed_lines(out) == list(range(1, 7))
    assert {e["speaker"] for e in manifest(out)} == {first.speaker}
    assert audio_files(out) == {f"{i:06d}.wav" for i in range(1, 7)}


def test_hand_edited_manifest_rows_are_skipped_by_row_number_and_their_lines_redone(chat, tmp_path, caplog):
    write_lines(tmp_path / "in.txt", [f"sentence {spelled(i)} here" for i in range(1, 9)])
    out = tmp_path / "out"
    cfg = config(out, random_speaker=True)
    first = synth(chat, str(tmp_path / "in.txt"), cfg)
    e = {entry["line"]: entry for entry in manifest(out)}
    rows = [json.dumps({k: v for k, v in e[4].items() if k != "speaker"}),  # 1: random speaker without a speaker
            json.dumps(e[1]), "[1, 2]", "", '"just a string"',  # 2: good, 3: a list, 4: blank, 5: a string
            json.dumps({k: v for k, v in e[2].items() if k != "file"}),  # 6: no file
            json.dumps(dict(e[3], text=5)), "not json at all",  # 7: text not a string, 8: not JSON
            json.dumps(dict(e[5], file=["x"])), json.dumps(dict(e[6], random_speaker=1)),  # 9, 10
            "[" * 100_000, json.dumps(e[7]), json.dumps(e[8])]  # 11: too deep; 12, 13: good, 13 without newline
    path = str(out / MANIFEST)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(rows))

    again = synth(chat, str(tmp_path / "in.txt"), cfg)

    warned = warned_rows(caplog, path)
    assert sorted(warned) == [1, 3, 5, 6, 7, 8, 9, 10, 11]
    assert "'speaker'" in warned[1] and "an array" in warned[3] and "a string" in warned[5] and "'file'" in warned[6]
    assert "'text'" in warned[7] and "JSON" in warned[8] and "'file'" in warned[9]
    assert "random_speaker" in warned[10] and "JSON" in warned[11]
    assert again.skipped == 3 and sorted(w["line"] for w in again.written) == [2, 3, 4, 5, 6] and not again.failed
    assert again.speaker == first.speaker
    after = open(path, encoding="utf-8").read().split("\n")
    assert after[:13] == rows and after[-1] == ""  # the rows kept as they were, the last one ended
    assert sorted(json.loads(row)["line"] for row in after[13:-1]) == [2, 3, 4, 5, 6]


def test_an_unreadable_manifest_or_a_resumed_speaker_of_another_model_names_the_manifest(chat, tmp_path, monkeypatch,
                                                                                        capsys):
    write_lines(tmp_path / "in.txt", ["hello there", "general kenobi"])
    (tmp_path / "a" / MANIFEST).mkdir(parents=True)
    assert run_cli(monkeypatch, chat, str(tmp_path / "in.txt"), "-o", str(tmp_path / "a")) == 2
    assert f"cannot read the manifest {tmp_path / 'a' / MANIFEST}" in capsys.readouterr().err

    other = encode_speaker(torch.ones(5))  # a well-formed speaker of another model
    (tmp_path / "b").mkdir()
    write_lines(tmp_path / "b" / MANIFEST, [{"line": 1, "text": "hello there", "file": "000001.wav",
                                             "random_speaker": True, "speaker": other}])
    assert run_cli(monkeypatch, chat, str(tmp_path / "in.txt"), "-o", str(tmp_path / "b"), "--random-speaker") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'b' / MANIFEST} row 1: the random speaker" in err and "5 values" in err


def test_a_full_disk_while_writing_audio_stops_with_one_line_naming_the_file(chat, tmp_path, monkeypatch, capsys):
    write_lines(tmp_path / "in.txt", [f"line {spelled(i)} of six" for i in range(1, 7)])
    out = str(tmp_path / "out")
    argv = (str(tmp_path / "in.txt"), "-o", out, "--concurrency", "1")  # one line at a time: line 4 fails
    disk = FullDisk(monkeypatch, lambda target: target.startswith(os.path.realpath(out)) and target.endswith(".part"),
                    allowed=3)

    assert run_cli(monkeypatch, chat, *argv) == 1

    err = capsys.readouterr().err
    assert error_lines(err) == [
        f"error: cannot write {out}/000004.wav: {ENOSPC}; the 3 lines written before it are kept, run the same "
        "command again to resume"]
    assert "line 4:" not in err  # not a failed line: the run stopped
    assert resumed_lines(out) == [1, 2, 3]
    assert audio_files(out) == {"000001.wav", "000002.wav", "000003.wav"}  # no partial file left

    disk.allowed = 10**9  # space freed
    assert run_cli(monkeypatch, chat, *argv) == 0
    summary = capsys.readouterr().out
    assert "3 lines written" in summary and "3 already done" in summary
    assert resumed_lines(out) == list(range(1, 7))


@pytest.mark.parametrize("name", [MANIFEST, ERRORS])
def test_a_full_disk_while_appending_a_row_cuts_the_row_off_and_stops_with_one_line(chat, tmp_path, monkeypatch,
                                                                                    capsys, name):
    with open(tmp_path / "in.txt", "wb") as f:  # line 2 is an error, which goes to errors.jsonl
        f.write(b"line one\n\xff\xfe not utf-8\n" + b"".join(f"line {spelled(i)}\n".encode() for i in range(3, 7)))
    out = str(tmp_path / "out")
    argv = (str(tmp_path / "in.txt"), "-o", out, "--concurrency", "1")
    target = os.path.join(os.path.realpath(out), name)
    allowed = 2 if name == MANIFEST else 0
    disk = FullDisk(monkeypatch, lambda t: t == target, allowed=allowed, partial=10)

    assert run_cli(monkeypatch, chat, *argv) == 1

    assert error_lines(capsys.readouterr().err) == [
        f"error: cannot write {out}/{name}: {ENOSPC}; the {allowed} lines written before it are kept, run the same "
        "command again to resume"]
    with open(os.path.join(out, name), "rb") as f:
        data = f.read()
    rows = data.split(b"\n")
    assert len(rows) == allowed + 1 and rows[-1] == b""  # the part of the row that landed was cut off again
    assert len(manifest(out)) == allowed

    disk.allowed = 10**9
    assert run_cli(monkeypatch, chat, *argv) == 1  # line 2 still fails, the others are done
    assert resumed_lines(out) == [1, 3, 4, 5, 6]
    summary = capsys.readouterr().out
    assert f"{5 - allowed} lines written" in summary and f"{allowed} already done" in summary and "1 FAILED" in summary


def test_a_file_size_limit_of_the_kernel_is_one_line_naming_the_file_not_system_error(upstream_ckpt, tmp_path):
    write_lines(tmp_path / "in.txt", ["hello there", "general kenobi"])
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "chattts_velocity.cli", "synth", str(tmp_path / "in.txt"), "-o", out,
           "--model", upstream_ckpt, "--device", "cpu", "--no-refine", "--max-new-token", str(TOKENS),
           "--concurrency", "1"]
    limit = 256  # bytes a file may grow to: under any wav but a header (Python ignores SIGXFSZ)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert proc.returncode == 1, proc.stderr
    assert error_lines(proc.stderr) == [
        f"error: cannot write {out}/000001.wav: {os.strerror(errno.EFBIG)}; the 0 lines written before it are "
        "kept, run the same command again to resume"]
    assert audio_files(out) == set()
