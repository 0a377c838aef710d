"""Upstream ChatTTS's public attributes of a loaded ``Chat`` (``tokenizer``, ``speaker``, ``config``, ``gpt``,
``embed``, ``dvae``, ``decoder``, ``vocos``, ``device_gpt``, ``coef``, ``download_models``), compared with upstream
0.2.5 loaded on the same tiny random checkpoint (the parity tests' oracle)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil

import numpy as np
import pytest
import torch

from chattts_velocity import Chat
from chattts_velocity.model.loader import ModelNotFoundError

TEXTS = ["What is [uv_break]your favorite english food?[laugh][lbreak]", "你好，是的。speech", "a b c"]
ATOL = 1e-5


def fixed_speaker(chat, seed: int = 0) -> str:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return chat.sample_random_speaker()


def assert_close(a, b, what: str) -> None:
    a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff = (a.double() - b.double()).abs().max().item()
    assert diff <= ATOL, f"{what}: max abs diff {diff:.3g} > {ATOL}"
    assert a.abs().max() > 1e-3, f"{what}: all near zero, the comparison proves nothing"


def regression_snippet(chat, text, params):
    """Upstream's regression script tests/#655.py, as written there (upstream's ``chat`` or ours)."""
    input_ids, attention_mask, text_mask = chat.tokenizer.encode(
        chat.speaker.decorate_code_prompts(
            text,
            params.prompt,
            params.txt_smp,
            params.spk_emb,
        ),
        chat.config.gpt.num_vq,
        prompt=(
            chat.speaker.decode_prompt(params.spk_smp)
            if params.spk_smp is not None
            else None
        ),
        device=chat.device_gpt,
    )
    with torch.inference_mode():
        start_idx, end_idx = 0, torch.zeros(
            input_ids.shape[0], device=input_ids.device, dtype=torch.long
        ).fill_(input_ids.shape[1])

        recoded_text = chat.tokenizer.decode(
            chat.gpt._prepare_generation_outputs(
                input_ids,
                start_idx,
                end_idx,
                [],
                [],
                True,
            ).ids
        )
    return (input_ids, attention_mask, text_mask), recoded_text


def voice_sample(chat) -> str:
    wav = (0.3 * np.random.default_rng(0).standard_normal(24000 // 2)).astype(np.float32)
    return chat.sample_audio_speaker(wav)


@pytest.mark.parametrize("with_voice_sample", [False, True])
def test_upstream_regression_script_runs_and_matches_upstream(chat, upstream_chat, with_voice_sample):
    spk = fixed_speaker(upstream_chat)
    smp = voice_sample(chat) if with_voice_sample else None
    ours = regression_snippet(chat, list(TEXTS), chat.InferCodeParams(spk_emb=spk, spk_smp=smp, txt_smp="hi"))
    theirs = regression_snippet(upstream_chat, list(TEXTS),
                                upstream_chat.InferCodeParams(spk_emb=spk, spk_smp=smp, txt_smp="hi"))
    for a, b, what in zip(ours[0], theirs[0], ("input_ids", "attention_mask", "text_mask"), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what} differ from upstream"
    assert ours[1] == theirs[1]
    assert ours[1][0].startswith("[Stts] [spk_emb] hi [speed_5] what is [uv_break] your favorite english food?")
    audio_positions = ours[0][1].bool() & ~ours[0][2]
    assert bool(audio_positions.any()) == with_voice_sample


def test_tokenizer_matches_upstream(chat, upstream_chat):
    codes = torch.randint(0, 626, (4, 7), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    ours = chat.tokenizer.encode(list(TEXTS), 4, prompt=codes, device=chat.device_gpt)
    theirs = upstream_chat.tokenizer.encode(list(TEXTS), 4, prompt=codes, device=upstream_chat.device_gpt)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    ids = [torch.tensor([5, 9, 200, 7]), [int(chat.tokenizer.spk_emb_ids), 30, 31]]
    assert chat.tokenizer.decode(ids) == upstream_chat.tokenizer.decode(ids)
    for kw in ({"skip_special_tokens": True}, {"clean_up_tokenization_spaces": True}):
        assert chat.tokenizer.decode(ids, **kw) == upstream_chat.tokenizer.decode(ids, **kw)
    for name in ("len", "spk_emb_ids", "break_0_ids", "eos_token"):
        assert getattr(chat.tokenizer, name) == getattr(upstream_chat.tokenizer, name), name


def test_speaker_matches_upstream(chat, upstream_chat):
    ours, theirs = chat.speaker, upstream_chat.speaker
    with torch.random.fork_rng():
        torch.manual_seed(3)
        drawn = ours.sample_random()
        torch.manual_seed(3)
        assert drawn == theirs.sample_random() == fixed_speaker(chat, 3)
    assert ours.dim == theirs.dim
    assert torch.equal(ours.std, theirs.std) and torch.equal(ours.mean, theirs.mean)
    for spk, smp in ((drawn, "smp"), (None, None)):
        assert ours.decorate_code_prompts(list(TEXTS), "[speed_5]", smp, spk) == theirs.decorate_code_prompts(
            list(TEXTS), "[speed_5]", smp, spk)
    assert ours.decorate_text_prompts(list(TEXTS), "[oral_2]") == theirs.decorate_text_prompts(list(TEXTS), "[oral_2]")
    codes = torch.randint(0, 626, (4, 9), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    assert ours.encode_prompt(codes) == theirs.encode_prompt(codes)
    assert torch.equal(ours.decode_prompt(theirs.encode_prompt(codes)), theirs.decode_prompt(ours.encode_prompt(codes)))
    vec = torch.from_numpy(theirs._decode(drawn))
    assert np.array_equal(ours._decode(drawn), vec.numpy()) and ours._encode(vec) == theirs._encode(vec) == drawn


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("inplace", [True, False])
def test_speaker_apply_matches_upstream(chat, upstream_chat, as_tensor, inplace):
    spk = fixed_speaker(upstream_chat, 5)
    if as_tensor:
        spk = torch.from_numpy(upstream_chat.speaker._decode(spk)).float()
    prompts = upstream_chat.speaker.decorate_code_prompts(list(TEXTS), "", None, "x")
    input_ids, _, text_mask = upstream_chat.tokenizer.encode(prompts, 4)
    emb = torch.randn(*input_ids.shape[:2], 64, generator=torch.Generator().manual_seed(0))
    ours_in, theirs_in = emb.clone(), emb.clone()
    ours = chat.speaker.apply(ours_in, spk, input_ids, chat.tokenizer.spk_emb_ids, chat.device_gpt, inplace=inplace)
    theirs = upstream_chat.speaker.apply(theirs_in, spk, input_ids, upstream_chat.tokenizer.spk_emb_ids,
                                         upstream_chat.device_gpt, inplace=inplace)
    assert torch.equal(ours, theirs) and not torch.equal(ours, emb)
    assert torch.equal(ours_in, theirs_in) and torch.equal(ours_in, emb) != inplace


def test_config_matches_upstream(chat, upstream_chat):
    assert dataclasses.asdict(chat.config) == dataclasses.asdict(upstream_chat.config)
    gpt = chat.config.gpt
    assert (gpt.num_vq, gpt.num_audio_tokens, gpt.num_text_tokens, gpt.hidden_size) == (4, 626, chat.tokenizer.len, 64)
    assert chat.config.path.gpt_ckpt_path == "asset/gpt"
    assert os.path.isfile(os.path.join(chat.model.root, chat.config.path.embed_path))
    with pytest.raises(dataclasses.FrozenInstanceError):
        chat.config.gpt.num_vq = 8


def test_config_before_load_is_upstreams_default():
    """Against a fresh copy of upstream's config module: ``Chat().config`` there is ``Config()``, whose defaults
    are shared instances that the oracle fixture changed in the imported one."""
    folder = os.path.dirname(importlib.util.find_spec("ChatTTS").origin)
    spec = importlib.util.spec_from_file_location("fresh_upstream_config", os.path.join(folder, "config", "config.py"))
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert dataclasses.asdict(Chat().config) == dataclasses.asdict(fresh.Config())


def test_gpt_core_and_heads_match_upstream(chat, upstream_chat):
    ours, theirs = chat.gpt, upstream_chat.gpt
    assert (ours.num_vq, ours.num_audio_tokens, ours.num_text_tokens, ours.is_vllm) == (
        theirs.num_vq, theirs.num_audio_tokens, theirs.num_text_tokens, theirs.is_vllm)
    assert chat.device_gpt == ours.device_gpt == upstream_chat.device_gpt
    sd, ref = ours.state_dict(), theirs.state_dict()
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
    spk = fixed_speaker(upstream_chat)
    (input_ids, attention_mask, text_mask), _ = regression_snippet(chat, list(TEXTS), chat.InferCodeParams(spk_emb=spk))
    pos = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask.eq(0), 1)
    with torch.inference_mode():
        embs = []
        for c in (chat, upstream_chat):
            emb = c.embed(input_ids, text_mask)
            c.speaker.apply(emb, spk, input_ids, c.tokenizer.spk_emb_ids, c.device_gpt)
            embs.append(emb)
        assert torch.equal(*embs), "prompt embeddings differ from upstream"
        hidden = [g.gpt(inputs_embeds=e, attention_mask=attention_mask, position_ids=pos).last_hidden_state
                  for g, e in ((ours, embs[0]), (theirs, embs[1]))]
        valid = attention_mask.bool()
        assert_close(hidden[0][valid], hidden[1][valid], "Llama hidden states")
        for q in range(4):
            assert_close(ours.head_code[q](hidden[0]), theirs.head_code[q](hidden[0]), f"code head {q}")
            assert torch.equal(ours.emb_code[q](input_ids[..., q] % 626), theirs.emb_code[q](input_ids[..., q] % 626))
        assert_close(ours.head_text(hidden[0]), theirs.head_text(hidden[0]), "text head")
        assert torch.equal(ours.emb_text(input_ids[..., 0]), theirs.emb_text(input_ids[..., 0]))
    assert (chat.embed.model_dim, chat.embed.num_audio_tokens, chat.embed.num_vq) == (
        upstream_chat.embed.model_dim, upstream_chat.embed.num_audio_tokens, upstream_chat.embed.num_vq)


def test_dvae_decoder_and_vocos_match_upstream(chat, upstream_chat):
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 625, (2, 4, 30), generator=gen)
    hiddens = torch.randn(2, 64, 30, generator=gen)
    mel = chat.dvae(codes)
    assert_close(mel, upstream_chat.dvae(codes.clone()), "DVAE mel")
    assert_close(chat.dvae(codes, mode="decode"), mel, "DVAE mel (mode='decode')")
    assert_close(chat.decoder(hiddens), upstream_chat.decoder(hiddens.clone()), "Decoder mel")
    assert_close(chat.vocos.decode(mel), upstream_chat.vocos.decode(mel.clone()), "Vocos wav")
    wav = (0.3 * np.random.default_rng(1).standard_normal(24000 // 2)).astype(np.float32)
    enc = chat.dvae(torch.from_numpy(wav), "encode")
    ref = upstream_chat.dvae(torch.from_numpy(wav.copy()), "encode")
    assert enc.dtype == ref.dtype and torch.equal(enc, ref)
    assert torch.equal(chat.dvae.sample_audio(wav), upstream_chat.dvae.sample_audio(wav.copy()))
    assert torch.equal(chat.dvae.coef, upstream_chat.dvae.coef)
    assert str(chat.dvae) == str(upstream_chat.dvae) == chat.coef
    assert str(chat.decoder) == str(upstream_chat.decoder)


def test_upstream_generation_names_point_to_the_replacement(chat):
    with pytest.raises(AttributeError, match=r"chat\.gpt\.generate: .*chat\.infer\(.*chat\.pipeline"):
        _ = chat.gpt.generate
    assert not hasattr(chat.gpt, "llm")
    with pytest.raises(NotImplementedError, match=r"chat\.infer\("):
        chat.gpt(torch.zeros(1, 2, 64))


def test_attributes_before_load_say_to_load():
    fresh = Chat()
    for name in ("tokenizer", "speaker", "gpt", "dvae", "decoder", "vocos", "embed", "device_gpt"):
        with pytest.raises(AttributeError, match=r"call Chat\.load\(\) first"):
            getattr(fresh, name)
        assert not hasattr(fresh, name)  # as upstream's, which sets them in load


def test_download_models_finds_the_hub_snapshot_like_upstream(upstream_ckpt, upstream_chat, tmp_path):
    snapshot = tmp_path / "models--2Noise--ChatTTS" / "snapshots" / "0123abcd"
    shutil.copytree(upstream_ckpt, snapshot)
    ours = Chat().download_models(source="huggingface", custom_path=str(tmp_path))
    assert ours == upstream_chat.download_models(source="huggingface", custom_path=str(tmp_path)) == str(snapshot)
    assert Chat().download_models("custom", custom_path=upstream_ckpt) == upstream_ckpt
    with pytest.raises(ModelNotFoundError, match="incomplete ChatTTS checkpoint"):
        Chat().download_models("custom", custom_path=str(tmp_path))


def test_load_reads_the_folder_download_models_gives(upstream_ckpt, upstream_chat):
    """``load`` goes through ``download_models`` (a subclass's override included), and ``chat.gpt`` brings back
    the Llama weights that an engine in another dtype let go."""
    asked = []

    class Recording(Chat):
        def download_models(self, source="local", force_redownload=False, custom_path=None):
            asked.append((source, force_redownload, custom_path))
            return super().download_models(source, force_redownload, custom_path)

    chat = Recording()
    try:
        assert chat.load(source="custom", custom_path=upstream_ckpt, device="cpu", num_kv_blocks=8,
                         engine_dtype="bfloat16")
        assert asked == [("custom", False, upstream_ckpt)]
        assert str(chat.model.root) == upstream_ckpt
        assert chat.model.gpt.llama_released, "the engine shares the weights: the case is not exercised"
        sd, ref = chat.gpt.state_dict(), upstream_chat.gpt.state_dict()
        assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
    finally:
        chat.unload()
