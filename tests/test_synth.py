"""``chattts-velocity synth``: every good line of a file becomes an audio file equal to ``Chat.infer`` of that line,
bad lines are reported with their numbers while the rest finish, an interrupted run resumes without redoing a
line, and usage errors stop before any model is loaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import soundfile as sf
import torch

from chattts_velocity import Chat, cli
from chattts_velocity.synth import ERRORS, MANIFEST, SynthConfig, SynthInterrupted, plan, synth
from chattts_velocity.text import encode_speaker

TOKENS = 8
"""Audio tokens per line: every line is forced to exactly this many (min = max), so its length is known."""
DIGITS = "zero one two three four five six seven eight nine".split()


def spelled(i: int) -> str:
    """``i`` in words (ChatTTS's normaliser drops digits), so every line's text differs."""
    return " ".join(DIGITS[int(d)] for d in str(i))


def config(out_dir, **kw) -> SynthConfig:
    return SynthConfig(out_dir=str(out_dir), refine=False, max_new_token=TOKENS, min_new_token=TOKENS,
                       show_progress=False, **kw)


def samples_for(chat, tokens: int) -> int:
    """What the Decoder + Vocos give for ``tokens`` tokens (before silent samples are dropped)."""
    hidden = torch.zeros(tokens, chat.model.config.hidden_size)
    return chat.audio.to_wavs([hidden], use_decoder=True).shape[1]


def manifest(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, MANIFEST), encoding="utf-8") as f:
        return [json.loads(row) for row in f]


def audio_files(out_dir) -> set[str]:
    return {name for name in os.listdir(out_dir) if not name.endswith(".jsonl")}


def infer_alone(chat, text: str, seed: int, speaker: str | None = None) -> np.ndarray:
    code = Chat.InferCodeParams(manual_seed=seed, spk_emb=speaker, max_new_token=TOKENS, min_new_token=TOKENS,
                                show_tqdm=False)
    return chat.infer(text, skip_refine_text=True, params_infer_code=code)[0]


def cli_synth(args, chat) -> int:
    """``chattts-velocity synth`` with ``chat`` as the model it loads."""
    from chattts_velocity.synth import cli as synth_cli

    return synth_cli(args, lambda: chat)


def write_lines(path, rows: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")


def test_two_hundred_lines_good_ones_written_at_their_length_bad_ones_listed(chat, tmp_path):
    speaker = chat.sample_random_speaker()
    wrong_dim = encode_speaker(torch.ones(5))  # a well-formed speaker string this model cannot use
    rows: list = [{"text": f"line {spelled(i)} of the batch"} for i in range(1, 201)]
    rows[9] = {"text": "line ten has its own seed", "seed": 42}
    rows[19] = {"text": "line twenty has a speaker", "speaker": speaker, "file": "twenty"}
    bad = {3: "{not json", 7: {"txt": "typo"}, 11: {"text": "   "}, 13: {"text": "x", "top_p": 3},
           17: {"text": "x", "seed": "one"}, 23: {"text": "x", "speaker": "not a speaker"},
           29: {"text": "x", "file": "../escape"}, 31: {"text": "x", "file": "twenty"},
           37: {"text": "right shape, wrong model", "speaker": wrong_dim}}
    for lineno, row in bad.items():
        rows[lineno - 1] = row
    rows[49] = rows[99] = ""  # blank lines are skipped, numbering goes on
    write_lines(tmp_path / "in.jsonl", rows)
    cfg = config(tmp_path / "out", seed=3)

    result = synth(chat, str(tmp_path / "in.jsonl"), cfg)

    reasons = {e.lineno: e.reason for e in result.failed}
    assert set(reasons) == set(bad)
    assert "JSON" in reasons[3] and "'txt'" in reasons[7] and "blank" in reasons[11] and "top_P" in reasons[13]
    assert "'seed'" in reasons[17] and "speaker" in reasons[23] and "file" in reasons[29]
    assert "line 20" in reasons[31] and "5 values" in reasons[37]
    with open(tmp_path / "out" / ERRORS, encoding="utf-8") as f:
        assert sorted(json.loads(row)["line"] for row in f) == sorted(bad)

    good = [i for i in range(1, 201) if i not in bad and i not in (50, 100)]
    entries = {e["line"]: e for e in manifest(cfg.out_dir)}
    assert sorted(entries) == good and len(result.written) == len(good)
    assert entries[20]["file"] == "twenty.wav" and entries[20]["speaker"] == speaker
    assert entries[10]["seed"] == 42 and entries[12]["seed"] == 3
    assert audio_files(cfg.out_dir) == {e["file"] for e in entries.values()}
    full = samples_for(chat, TOKENS)
    for lineno, e in entries.items():
        info = sf.info(os.path.join(cfg.out_dir, e["file"]))
        assert info.samplerate == 24000 and info.frames == round(e["duration"] * 24000)
        assert full - 8 <= info.frames <= full, f"line {lineno}: {info.frames} samples for {TOKENS} tokens"

    for lineno, seed, spk in [(1, 3, None), (10, 42, None), (20, 3, speaker)]:  # the same line alone
        alone = infer_alone(chat, rows[lineno - 1]["text"], seed, spk)
        written, _ = sf.read(os.path.join(cfg.out_dir, entries[lineno]["file"]), dtype="float32")
        assert written.shape == alone.shape
        np.testing.assert_allclose(written, np.clip(alone, -1, 1), atol=2e-4)


def test_interrupted_run_resumes_without_redoing_a_line(chat, tmp_path):
    write_lines(tmp_path / "in.txt", [f"sentence {spelled(i)} to speak" for i in range(1, 41)])
    cfg = config(tmp_path / "out", random_speaker=True, concurrency=4)
    seen = []

    def stop_after_ten(outcome):
        seen.append(outcome)
        if len(seen) == 10:
            raise KeyboardInterrupt

    with pytest.raises(SynthInterrupted) as info:
        synth(chat, str(tmp_path / "in.txt"), cfg, on_line=stop_after_ten)
    first = manifest(cfg.out_dir)
    assert 10 <= len(first) < 40 and len(info.value.result.written) == len(first)
    assert audio_files(cfg.out_dir) == {e["file"] for e in first}  # nothing half-done, nothing unlisted
    mtimes = {e["file"]: os.stat(os.path.join(cfg.out_dir, e["file"])).st_mtime_ns for e in first}
    cut = '{"line": 40, "text": "sentence four zero to sp'  # a crash in the middle of an entry
    with open(os.path.join(cfg.out_dir, MANIFEST), "a", encoding="utf-8") as f:
        f.write(cut)

    again = synth(chat, str(tmp_path / "in.txt"), cfg)

    assert again.skipped == len(first) and len(again.written) == 40 - len(first) and not again.failed
    rows = open(os.path.join(cfg.out_dir, MANIFEST), encoding="utf-8").read().splitlines()
    entries = [json.loads(row) for row in rows]  # the cut entry was cut off the file, not kept as a row
    assert cut not in rows and len(entries) == 40
    assert sorted(e["line"] for e in entries) == list(range(1, 41))
    assert all(os.stat(os.path.join(cfg.out_dir, f)).st_mtime_ns == t for f, t in mtimes.items())
    assert len({e["speaker"] for e in entries}) == 1 and all(e["random_speaker"] for e in entries)
    assert again.speaker == entries[0]["speaker"]


def test_cli_exit_codes_are_0_clean_1_some_failed_2_usage(chat, tmp_path, monkeypatch, capsys):
    write_lines(tmp_path / "good.txt", ["hello there", "", "general kenobi"])
    with open(tmp_path / "mixed.txt", "wb") as f:
        f.write(b"first line\n\xff\xfe not utf-8\nthird line\n")

    def args(*argv):
        return cli.build_parser().parse_args(["synth", *argv, "--no-refine", "--max-new-token", str(TOKENS)])

    assert cli_synth(args(str(tmp_path / "good.txt"), "-o", str(tmp_path / "a"), "--format", "flac"), chat) == 0
    assert audio_files(tmp_path / "a") == {"000001.flac", "000003.flac"}
    assert "2 lines written" in capsys.readouterr().out
    assert cli_synth(args(str(tmp_path / "mixed.txt"), "-o", str(tmp_path / "b")), chat) == 1
    out = capsys.readouterr()
    assert "1 FAILED" in out.out and "line 2: not UTF-8" in out.err
    assert audio_files(tmp_path / "b") == {"000001.wav", "000003.wav"}

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model was loaded for a usage error"))
    (tmp_path / "plain_file").write_text("")
    for argv in (["synth", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "c"), "--dummy"],
                 ["synth", str(tmp_path / "good.txt"), "-o", str(tmp_path / "plain_file" / "sub"), "--dummy"],
                 ["synth", str(tmp_path / "good.txt"), "-o", str(tmp_path / "c"), "--seed", "-1", "--dummy"]):
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot read the input file" in err and "cannot write to the output folder" in err and "manual_seed" in err


def test_the_cli_engine_batch_defaults_by_device_and_is_passed_to_the_load(monkeypatch, tmp_path):
    """``synth`` loads a 256-sequence engine on CUDA and a 64-sequence one on the CPU, unless told."""
    import torch as _torch

    assert cli.synth_max_num_seqs("cpu") == 64
    monkeypatch.setattr(cli, "resolve_device", lambda device: _torch.device("cuda"))
    assert cli.synth_max_num_seqs(None) == 256
    loads = []
    monkeypatch.setattr(cli, "load_chat", lambda load, **kw: loads.append(load))
    monkeypatch.setattr(cli, "synth_cli", lambda args, load: load())
    write_lines(tmp_path / "in.txt", ["hello"])
    for extra, seqs in (([], 256), (["--max-num-seqs", "12"], 12)):
        args = cli.build_parser().parse_args(["synth", str(tmp_path / "in.txt"), "-o", str(tmp_path / "o"),
                                              "--dummy", *extra])
        cli._synth(args)
        assert loads[-1]["max_num_seqs"] == seqs


def test_a_jsonl_line_nested_too_deep_is_a_bad_line_not_a_crash(tmp_path):
    write_lines(tmp_path / "in.jsonl", ["[" * 100_000, {"text": "fine"}])
    job = plan(str(tmp_path / "in.jsonl"), config(tmp_path / "out"))
    assert [e.lineno for e in job.errors] == [1] and "not valid JSON" in job.errors[0].reason
    assert [line.text for line in job.todo] == ["fine"]


def test_mp3_needs_a_libsndfile_that_writes_it(tmp_path, monkeypatch):
    formats = {k: v for k, v in sf.available_formats().items() if k != "MP3"}
    monkeypatch.setattr(sf, "available_formats", lambda: formats)
    with pytest.raises(ValueError, match="cannot write mp3"):
        SynthConfig(out_dir=str(tmp_path), fmt="mp3")


def test_ctrl_c_keeps_what_is_written_and_says_how_to_resume(upstream_ckpt, chat, tmp_path):
    write_lines(tmp_path / "in.txt", [f"line {spelled(i)} to speak slowly" for i in range(1, 301)])
    out = tmp_path / "out"
    # -X faulthandler: a child that hangs after the signal is stopped with SIGABRT, which prints every thread's stack
    cmd = [sys.executable, "-X", "faulthandler", "-m", "chattts_velocity.cli", "synth", str(tmp_path / "in.txt"),
           "-o", str(out), "--model", upstream_ckpt, "--device", "cpu", "--no-refine", "--max-new-token",
           str(TOKENS), "--concurrency", "4"]
    # Ctrl-C's default action in the child even where this process ignores SIGINT (a child inherits an ignored
    # signal, and Python then installs no KeyboardInterrupt handler): the full suite ran 1,000 lines to the end
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 150  # generous: the CPU may be shared
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(out / MANIFEST) and len(manifest(out)) >= 5:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"synth still running 90 s after Ctrl-C; its threads:\n{err[-20000:]}")
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "run the same command again to resume" in err
    first = manifest(out)
    assert 5 <= len(first) < 300
    assert audio_files(out) == {e["file"] for e in first}

    again = synth(chat, str(tmp_path / "in.txt"), config(out))
    assert again.skipped == len(first) and len(again.written) == 300 - len(first)
    assert sorted(e["line"] for e in manifest(out)) == list(range(1, 301))


CTRL_C_TRIALS = r"""
import json, os, random, signal, sys, tempfile, threading, time
import numpy as np
from chattts_velocity.synth import ERRORS, MANIFEST, SynthConfig, SynthInterrupted, synth

class QuickChat:
    # lines of a millisecond or two: the main thread is mostly in the run's own bookkeeping when Ctrl-C lands
    class engine:
        class config:
            max_num_seqs = 4
    def infer(self, text, **kw):
        time.sleep(random.random() * 0.002)
        return [np.zeros(240, np.float32)]
    def interrupt(self):
        pass

random.seed(int(sys.argv[1]))
seen = {"interrupted": 0, "before the lines": 0, "finished first": 0}
with tempfile.TemporaryDirectory() as tmp:
    for trial in range(int(sys.argv[2])):
        out = os.path.join(tmp, str(trial))
        try:
            ctrl_c = threading.Timer(random.random() * 0.2, os.kill, (os.getpid(), signal.SIGINT))
            ctrl_c.start()
            try:
                synth(QuickChat(), [f"line {i}" for i in range(3000)], SynthConfig(out_dir=out, show_progress=False,
                                                                                  concurrency=4, refine=False))
                seen["finished first"] += 1
            except SynthInterrupted as e:
                seen["interrupted"] += 1
                with open(os.path.join(out, MANIFEST)) as f:
                    listed = {json.loads(row)["file"] for row in f}
                on_disk = {n for n in os.listdir(out) if n not in (MANIFEST, ERRORS)}
                assert listed == on_disk == {row["file"] for row in e.result.written}, (trial, len(listed), len(on_disk))
            ctrl_c.join()
        except KeyboardInterrupt:  # before synth started its run (or after it finished)
            seen["before the lines"] += 1
        deadline = time.monotonic() + 10
        while any(t.name.startswith("synth_") for t in threading.enumerate()):
            if time.monotonic() > deadline:
                print(f"trial {trial}: worker threads stuck after Ctrl-C", flush=True)
                os._exit(3)
            time.sleep(0.01)
print(json.dumps(seen))
"""


def test_ctrl_c_at_any_moment_stops_the_run_and_no_worker_hangs(tmp_path):
    """Ctrl-C at random moments of runs of very quick lines, 40 times. A KeyboardInterrupt raised inside the
    futures' locking used to leave a lock held: the workers hung in ``set_result`` and the process never exited
    (about one trial in ten)."""
    # Ctrl-C as a terminal sends it, even where this test's own process ignores SIGINT (started in the
    # background of a shell without job control), which the child would inherit
    proc = subprocess.run([sys.executable, "-c", CTRL_C_TRIALS, "7", "40"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["interrupted"] >= 20, seen

