"""A newcomer's first run: a streamed FLAC that soundfile reads (a real server), the README's ``openai`` snippet run
as written against it, ``say`` over a test-size checkpoint (capped as ``--dummy`` is) and into mp3, and every
option of the command line stating its default in ``--help``."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from server_helpers import ServerProcess

from chattts_velocity import Chat
from chattts_velocity.cli import build_parser, main
from chattts_velocity.constants import SAMPLES_PER_TOKEN
from chattts_velocity.model.gpt_config import FULL_GPT, GPTConfig
from chattts_velocity.say import RANDOM_MAX_NEW_TOKEN, is_test_size

ROOT = Path(__file__).resolve().parents[1]
TEXT = "Hello there. This is a test of the speech server."


@pytest.fixture(scope="module")
def server(upstream_ckpt):
    """A server without an API key, as the README starts it (its snippet sends ``api_key="unused"``)."""
    srv = ServerProcess(upstream_ckpt, "--max-new-token", "48", api_key=None)
    yield srv
    assert srv.stop() == 0


def speech(server, **body) -> bytes:
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=60,
                      json={"model": "tts-1", "voice": "alloy", "input": TEXT, "seed": 7, **body}) as r:
        assert r.status_code == 200, r.read()
        return b"".join(r.iter_bytes())


def assert_same_audio(samples: np.ndarray, pcm: bytes) -> None:
    """The same seed's audio: same length, the same int16 samples up to float rounding (a few steps: the decode
    windows are batched with whatever else is live)."""
    reference = np.frombuffer(pcm, "<i2").astype(np.int32)
    assert samples.shape == reference.shape and samples.size > 0
    assert np.abs(samples.astype(np.int32) - reference).max() <= 4


def test_a_streamed_flac_response_reads_back_with_soundfile(server):
    pcm = speech(server, response_format="pcm")
    samples, rate = sf.read(io.BytesIO(speech(server, response_format="flac")), dtype="int16")
    assert rate == 24000
    assert_same_audio(samples, pcm)


def test_a_flac_sent_as_sse_deltas_reads_back_with_soundfile(server):
    events = [json.loads(line[len("data: "):]) for line in speech(server, response_format="flac",
                                                                   stream_format="sse").decode().splitlines()
              if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    flac = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    samples, _ = sf.read(io.BytesIO(flac), dtype="int16")
    assert_same_audio(samples, speech(server, response_format="pcm"))


def test_the_readmes_openai_snippet_runs_as_written(server, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    (snippet,) = [block for block in blocks if "from openai import OpenAI" in block]
    assert "http://127.0.0.1:8000/v1" in snippet
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), {})
    info = sf.info(str(tmp_path / "a.mp3"))
    assert info.samplerate == 24000 and info.frames > 0


@pytest.fixture
def infer_params(monkeypatch) -> dict:
    """The parameters ``say`` passes to ``Chat.infer``, once it ran."""
    seen, real_infer = {}, Chat.infer

    def spy(self, text, **kw):
        seen["code"], seen["refine"] = kw["params_infer_code"], kw["params_refine_text"]
        return real_infer(self, text, **kw)

    monkeypatch.setattr(Chat, "infer", spy)
    return seen


def test_say_over_a_test_size_checkpoint_stops_each_pass_as_dummy_does(upstream_ckpt, tmp_path, capsys,
                                                                       infer_params):
    out = tmp_path / "tiny.wav"
    assert main(["say", "Hello there. How are you today.", "--model", upstream_ckpt, "--device", "cpu",
                 "-o", str(out)]) == 0
    assert infer_params["code"].max_new_token == infer_params["refine"].max_new_token == RANDOM_MAX_NEW_TOKEN
    assert sf.info(str(out)).frames <= 2 * RANDOM_MAX_NEW_TOKEN * SAMPLES_PER_TOKEN  # two sentences
    printed = capsys.readouterr().out
    assert "a test-size checkpoint" in printed and f"each pass stops at {RANDOM_MAX_NEW_TOKEN} tokens" in printed


def test_say_max_new_token_overrides_the_cap(upstream_ckpt, tmp_path, capsys, infer_params):
    assert main(["say", "Hello there.", "--model", upstream_ckpt, "--device", "cpu", "--no-refine",
                 "--max-new-token", "20", "-o", str(tmp_path / "x.wav")]) == 0
    assert infer_params["code"].max_new_token == 20
    assert "each pass stops" not in capsys.readouterr().out


def test_only_a_checkpoint_smaller_than_chattts_counts_as_test_size():
    assert not is_test_size(FULL_GPT)  # the released weights' shapes: say's default stays 2048
    assert is_test_size(GPTConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=4, num_hidden_layers=2))


def test_say_writes_mp3_as_synth_does(upstream_ckpt, tmp_path):
    out = tmp_path / "hello.mp3"
    assert main(["say", "Hello there.", "--model", upstream_ckpt, "--device", "cpu", "--no-refine",
                 "--max-new-token", "16", "-o", str(out)]) == 0
    info = sf.info(str(out))
    assert info.format == "MP3" and info.samplerate == 24000 and info.channels == 1 and info.frames > 0


def test_say_refuses_an_unknown_extension_naming_the_formats(tmp_path, capsys):
    assert main(["say", "hi", "-o", str(tmp_path / "x.m4a")]) == 2
    assert "output must end in .wav, .flac, .mp3, .ogg, got" in capsys.readouterr().err


def subcommands() -> dict:
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def test_every_option_of_every_subcommand_states_its_default():
    checked = 0
    for name, sub in subcommands().items():
        for action in sub._actions:
            if not action.option_strings or action.nargs == 0 or action.required:  # flags are off unless given
                continue
            assert "(default: " in (action.help or ""), (name, action.option_strings)
            checked += 1
    assert checked > 50


def test_help_shows_the_ports_and_what_source_local_means():
    subs = subcommands()
    assert re.search(r"--port PORT\s+port to listen on \(default: 8000\)", subs["serve"].format_help())
    assert re.search(r"--port PORT\s+port to listen on \(default: 7860\)", subs["webui"].format_help())
    source = " ".join(subs["say"].format_help().split())
    assert "local, the upstream layout (asset/) in the working directory" in source
