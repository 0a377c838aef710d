"""The engine seam in one process: ``SpeechKit`` prepares what the ``Chat`` would (and refuses what its engine
would, naming the sentence), ``VoiceRegistry`` resolves voices from the speaker statistics alone, and every
``LocalClient`` call does what the ``Chat`` does (its audio, its refine pass, its voice encoder), with a
cancelled refine pass aborting its engine requests."""

from __future__ import annotations

import asyncio
import json
import pickle
import time

import numpy as np
import pytest
from seam_helpers import check_cancelled_refine_aborts, engine_is_idle

from chattts_velocity.audio.pump import take_ready
from chattts_velocity.engine import EngineStats
from chattts_velocity.params import InferCodeParams, RefineTextParams
from chattts_velocity.serving.client import EngineInfo
from chattts_velocity.serving.kit import SpeechKit
from chattts_velocity.serving.local import LocalClient
from chattts_velocity.serving.voices import OPENAI_VOICES, UnknownVoiceError, VoiceRegistry

TEXT = "One sentence here. And a second one!"



def params(voice, seed: int = 1, tokens: int = 40) -> InferCodeParams:
    return InferCodeParams(spk_emb=voice.spk_emb, manual_seed=seed, max_new_token=tokens, min_new_token=tokens,
                           show_tqdm=False)


def test_the_kit_prepares_what_the_chat_prepares_and_refuses_what_the_engine_would(chat):
    kit = pickle.loads(pickle.dumps(SpeechKit.of(chat)))  # as an engine process's front gets it
    texts = kit.prepare_texts(TEXT)
    assert texts == chat.prepare_texts(TEXT) and len(texts) == 2
    with pytest.raises(ValueError, match="empty"):
        kit.prepare_texts("   ")
    spk = chat.sample_random_speaker()
    p = InferCodeParams(spk_emb=spk, manual_seed=3, show_tqdm=False)
    prompts, got = kit.prompts(texts, p)
    assert got == chat.pipeline.code_params(p)
    for ours, theirs in zip(prompts, chat.pipeline.code_prompts(texts, p), strict=True):
        assert ours.ids.equal(theirs.ids) and ours.text_mask.equal(theirs.text_mask) and ours.speaker.equal(theirs.speaker)
    fits, too_long = sorted(texts, key=lambda t: kit.prompts([t], p)[0][0].ids.shape[0])
    room = kit.prompts([fits], p)[0][0].ids.shape[0] + 1  # KV cache for the shorter one only
    short = SpeechKit(kit.tokenizer, kit.config, kit.speaker_stats, kv_capacity=room)
    with pytest.raises(ValueError, match="^sentence 2: prompt of .* leaves no room to generate: the KV cache"):
        short.prompts([fits, too_long], p)
    with pytest.raises(ValueError, match="^prompt of"):  # one sentence: not numbered
        short.prompts([too_long], p)


def test_voices_resolve_from_the_speaker_statistics_alone(chat, tmp_path):
    kit = SpeechKit.of(chat)
    front = VoiceRegistry(kit.speaker_stats, kit.config.hidden_size)
    engine = LocalClient(chat).voices
    assert [v.id for v in front.list()] == list(OPENAI_VOICES)
    assert front.resolve("Alloy") == engine.resolve("alloy") and front.resolve("alloy").spk_emb
    speaker = chat.sample_random_speaker()
    assert front.resolve({"id": speaker}).spk_emb == speaker
    with pytest.raises(UnknownVoiceError, match="unknown voice"):
        front.resolve("nobody")
    with pytest.raises(UnknownVoiceError, match="speaker string"):
        front.resolve("x" * 100)
    with pytest.raises(RuntimeError, match="register_voice"):  # no encoder here: the engine registers
        front.register("mine", np.zeros(24000, np.float32), "what is said")
    builtin_default = VoiceRegistry(None, kit.config.hidden_size)  # no speaker statistics: the model's default
    assert builtin_default.resolve("alloy").spk_emb is None


def test_local_audio_is_the_pipelines(chat):
    client = LocalClient(chat)
    assert client.info == EngineInfo(str(chat.device), chat.engine.config.max_num_seqs)
    p = params(client.voices.resolve("echo"))
    texts = client.kit.prepare_texts(TEXT)
    audio = client.start(*client.kit.prompts(texts, p), 4)
    audio.start()
    got = np.concatenate(list(audio))
    want = np.concatenate(list(chat.pipeline.stream_joined(texts, p, use_decoder=True, in_flight=4)))
    # the same tokens; windows decoded in batches of another make-up differ in float rounding only
    assert got.size == want.size > 0 and np.allclose(got, want, rtol=0, atol=1e-5)
    assert engine_is_idle(chat)


def test_refine_register_stats_and_health(chat, tmp_path, monkeypatch):
    client = LocalClient(chat, voices_dir=str(tmp_path))
    refine = RefineTextParams(manual_seed=2, max_new_token=12, show_tqdm=False)
    wav = (0.3 * np.random.default_rng(0).standard_normal(24000)).astype(np.float32)

    async def calls():
        return (await client.refine(["hello world", "a b c"], refine),
                await client.register_voice("mine", wav, " what is said "), await client.stats())

    refined, voice, stats = asyncio.run(calls())
    assert refined == chat.pipeline.refine_texts(["hello world", "a b c"], refine)
    assert voice.spk_smp == chat.sample_audio_speaker(wav) and voice.name == "mine"
    assert client.voices.resolve(voice.id) == voice
    with open(tmp_path / f"{voice.id}.json", encoding="utf-8") as f:
        assert json.load(f)["txt_smp"] == "what is said"
    assert VoiceRegistry(None, 8, str(tmp_path)).resolve(voice.id) == voice  # kept across restarts
    with pytest.raises(ValueError, match="transcript"):
        asyncio.run(client.register_voice("mine", wav, " "))
    assert isinstance(stats, EngineStats) and stats.num_generated_tokens > 0
    assert client.health() is None

    def stalled(stall_s: float = 60.0) -> None:
        raise RuntimeError("the engine has had work for over 60 s without finishing a step")

    monkeypatch.setattr(chat.engine, "check_health", stalled)
    assert client.health() == "the engine has had work for over 60 s without finishing a step"


def test_a_cancelled_refine_aborts_its_engine_requests(chat):
    check_cancelled_refine_aborts(LocalClient(chat), chat)


def test_a_cancelled_audio_aborts_its_engine_requests(chat):
    client = LocalClient(chat)
    long = " ".join(f"Sentence {i} of a request that is cancelled early." for i in range(6))
    p = params(client.voices.resolve("alloy"), tokens=300)
    before = chat.engine.stats().engine.num_generated_tokens
    audio = client.start(*client.kit.prompts(client.kit.prepare_texts(long), p), 4)
    audio.on_ready(lambda: None)
    audio.start()
    deadline = time.monotonic() + 60
    while take_ready(audio)[0] is None:  # generating
        assert time.monotonic() < deadline, "no audio came"
        time.sleep(0.005)
    audio.cancel()
    assert engine_is_idle(chat)
    assert chat.engine.stats().engine.num_generated_tokens - before < 6 * 300
