"""Every script in ``examples/`` runs against a tiny checkpoint and writes what it says it wrote. The scripts run
as subprocesses, all at once (each spends most of its time importing and loading), the speech-server clients
against a server of their own. Without weights or without a server, each fails as the command line does: one
line, exit status 2."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import soundfile as sf
from server_helpers import API_KEY, ServerProcess, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 16
SECONDS_PER_TOKEN = 512 / 24000
EXAMPLES = {
    "offline": ["--no-refine", "--text", "Hello there. This is the second sentence."],
    "batch": [],
    "voice_clone": [],
    "streaming": [],
    "engine_direct": [],
}
CLIENT_INPUT = "Hello from the server. A second sentence."
INTERRUPT_S = 0.3
"""voice_agent's user interrupts this long into the first answer's audio, while its LLM is still writing it."""


PARALLEL = 2
"""Example processes at a time (beside the server): each is mostly imports and loading, one core's worth."""


@pytest.fixture(scope="module")
def runs(upstream_ckpt, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, str]]:
    """name -> (finished process, its output folder)."""
    model = ["--model", upstream_ckpt, "--device", "cpu", "--max-new-token", str(TOKENS)]
    waiting = [(name, model + args) for name, args in EXAMPLES.items()]
    running: dict[str, tuple[subprocess.Popen, str]] = {}
    done: dict[str, tuple[subprocess.CompletedProcess, str]] = {}

    def start(name: str, args: list[str]) -> None:
        out = str(tmp_path_factory.mktemp(name))
        cmd = [sys.executable, os.path.join(ROOT, "examples", f"{name}.py"), *args, "--out", out]
        running[name] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out)

    def reap(block: bool) -> None:
        for name, (proc, out) in list(running.items()):
            if block or proc.poll() is not None:
                try:
                    stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    stdout, stderr = proc.communicate()
                done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out)
                del running[name]

    deadline = time.monotonic() + 300
    for name, args in waiting[:PARALLEL]:
        start(name, args)
    server = ServerProcess(upstream_ckpt, "--max-new-token", str(TOKENS))  # comes up while those two run
    try:
        waiting = waiting[PARALLEL:] + [("openai_client", ["--base-url", server.url + "/v1", "--api-key", API_KEY,
                                                            "--seed", "1", "--input", CLIENT_INPUT]),
                                        ("voice_agent", ["--url", server.url.replace("http://", "ws://"),
                                                         "--api-key", API_KEY, "--seed", "1",
                                                         "--interrupt-after", str(INTERRUPT_S)])]
        while (waiting or running) and time.monotonic() < deadline:
            reap(block=False)
            while waiting and len(running) < PARALLEL:
                start(*waiting.pop(0))
            time.sleep(0.1)
        reap(block=True)
    finally:
        for proc, _ in running.values():
            proc.kill()
        server.stop()
    return done


def finished(runs, name: str) -> tuple[str, str]:
    proc, out = runs[name]
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout, out


def seconds(path: str) -> float:
    info = sf.info(path)
    assert info.samplerate == 24000 and info.channels == 1
    return info.frames / 24000


def printed_seconds(stdout: str, path: str) -> float:
    return float(re.search(re.escape(path) + r":.*?([\d.]+) s", stdout).group(1))


def test_offline_writes_the_wav_it_reports(runs):
    stdout, out = finished(runs, "offline")
    path = os.path.join(out, "offline.wav")
    assert 0 < seconds(path) <= 2 * TOKENS * SECONDS_PER_TOKEN  # two sentences of at most TOKENS tokens
    assert abs(seconds(path) - printed_seconds(stdout, path)) < 0.01


def test_batch_writes_the_good_lines_and_reports_the_bad_one(runs):
    stdout, out = finished(runs, "batch")
    files = sorted(f for f in os.listdir(out) if f.endswith(".wav"))
    assert files == ["000001.wav", "000002.wav", "000005.wav", "custom_name.wav"]
    assert "line 4 failed: top_P=3" in stdout and "4 written, 0 already done, 1 failed" in stdout
    for name in files:
        assert 0 < seconds(os.path.join(out, name)) <= TOKENS * SECONDS_PER_TOKEN
    with open(os.path.join(out, "manifest.jsonl")) as f:
        assert len(f.read().splitlines()) == 4


def test_voice_clone_makes_a_sample_then_speaks_in_its_voice(runs):
    stdout, out = finished(runs, "voice_clone")
    assert "no --sample given" in stdout
    assert seconds(os.path.join(out, "sample.wav")) > 0
    path = os.path.join(out, "cloned.wav")
    assert 0 < seconds(path) <= TOKENS * SECONDS_PER_TOKEN
    assert abs(seconds(path) - printed_seconds(stdout, path)) < 0.01


def test_streaming_writes_every_chunk_it_received(runs):
    stdout, out = finished(runs, "streaming")
    first_ms = float(re.search(r"first chunk after (\d+) ms", stdout).group(1))
    path = os.path.join(out, "streamed.wav")
    chunks = int(re.search(r"(\d+) chunks", stdout).group(1))
    assert first_ms > 0 and chunks >= 1
    assert 0 < seconds(path) <= TOKENS * SECONDS_PER_TOKEN
    assert abs(seconds(path) - printed_seconds(stdout, path)) < 0.01


def test_engine_direct_decodes_every_request(runs):
    stdout, out = finished(runs, "engine_direct")
    for i in range(3):
        path = os.path.join(out, f"engine_{i}.wav")
        tokens = int(re.search(re.escape(path) + r": (\d+) tokens", stdout).group(1))
        assert 1 <= tokens <= TOKENS
        assert abs(seconds(path) - tokens * SECONDS_PER_TOKEN) <= SECONDS_PER_TOKEN  # one token's worth of edge
    assert re.search(r"\d+ engine steps in [\d.]+ s, \d+ tokens generated, largest batch 3", stdout)


def test_openai_client_streams_pcm_into_a_wav(runs):
    stdout, out = finished(runs, "openai_client")
    path = os.path.join(out, "speech.wav")
    assert "first audio after" in stdout
    assert 0 < seconds(path) <= 2 * TOKENS * SECONDS_PER_TOKEN  # two sentences of at most TOKENS tokens
    assert abs(seconds(path) - printed_seconds(stdout, path)) < 0.01


def test_voice_agent_is_interrupted_then_answers_in_a_new_context(runs):
    stdout, out = finished(runs, "voice_agent")
    first, second = stdout.split("answer-2, in a new context on the same socket:")
    assert f"the user interrupts after {INTERRUPT_S:g} s -> context.cancel" in first
    played = float(re.search(r"answer-1: cancelled, [\d.]+ s of audio received, ([\d.]+) s played", first).group(1))
    assert 0 < played <= INTERRUPT_S + 0.1  # playback stopped at the interruption (a tick or a late wake-up more)
    done = float(re.search(r"answer-2: done, ([\d.]+) s of audio", second).group(1))
    segments = [(float(a), float(b)) for a, b in re.findall(r"\[([\d.]+)-([\d.]+) s\] \S", second)]
    assert len(segments) == 2 and segments[0][0] == 0
    assert segments[0][1] == segments[1][0]  # its two sentences, back to back
    assert 0 < done and abs(segments[-1][1] - done) <= 0.01  # the segments cover the audio
    path = os.path.join(out, "voice_agent.wav")
    assert abs(seconds(path) - printed_seconds(stdout, path)) < 0.01
    assert abs(seconds(path) - played - done) < 0.02  # what the user heard: the first answer cut, then the second


def test_voice_agent_without_a_server_is_a_clean_error(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.join(ROOT, "examples", "voice_agent.py"), "--url", f"ws://127.0.0.1:{port}",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: ws://127.0.0.1:{port}/v1/audio/speech/stream: ")
    assert proc.stderr.count("\n") == 1  # one line


def test_examples_without_weights_fail_as_the_cli_does(tmp_path):
    """No ``--model`` and no weights in the Hugging Face cache (offline): the CLI's one-line error, not a
    traceback."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "chattts_velocity.cli", "say", "hi", "-o", str(tmp_path / "x.wav")]
    commands = {"cli": cli, **{name: [sys.executable, os.path.join(ROOT, "examples", f"{name}.py"), "--out",
                                       str(tmp_path / name)] for name in EXAMPLES}}
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for name, cmd in commands.items()}
    ends = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2 and "Traceback" not in stderr, (name, stderr[-3000:])
        ends[name] = stderr.splitlines()[-1]
    assert ends["cli"].startswith("error: ChatTTS weights not found")
    assert all(end == ends["cli"] for end in ends.values()), ends


def test_openai_client_without_a_server_is_a_clean_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nobody listens there
    cmd = [sys.executable, os.path.join(ROOT, "examples", "openai_client.py"), "--base-url", url, "--out",
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {url}: ")
    assert proc.stderr.count("\n") == 1  # one line
