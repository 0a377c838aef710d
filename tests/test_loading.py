"""Loading: the upstream layout written by make-checkpoint, the Hugging Face cache offline, dummy weights, and
clear errors for missing, partial or inconsistent checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from chattts_velocity import Chat
from chattts_velocity.cli import main
from chattts_velocity.model.loader import ModelNotFoundError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    assert main(["make-checkpoint", str(root), "--size", "tiny", "--seed", "3"]) == 0
    return root


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_make_checkpoint_writes_the_upstream_layout(tiny_dir):
    for rel in ["asset/gpt/config.json", "asset/gpt/model.safetensors", "asset/Embed.safetensors",
                "asset/DVAE.safetensors", "asset/Decoder.safetensors", "asset/Vocos.safetensors",
                "asset/tokenizer/tokenizer.json", "asset/tokenizer/tokenizer_config.json",
                "asset/spk_stat.safetensors"]:
        assert (tiny_dir / rel).is_file(), rel
    cfg = json.loads((tiny_dir / "asset/gpt/config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 64
    embed = load_file(tiny_dir / "asset/Embed.safetensors")
    assert "head_code.3.parametrizations.weight.original1" in embed
    assert not any(k.startswith("embed_tokens") for k in load_file(tiny_dir / "asset/gpt/model.safetensors"))


def test_upstream_loads_our_checkpoint_and_agrees(tiny_dir):
    """Our writer's files are read by upstream's own loader, and both decode the same wav."""
    from upstream_checkpoint import load_upstream

    up = load_upstream(str(tiny_dir))
    ours = Chat()
    ours.load(source="custom", custom_path=tiny_dir, device="cpu")
    kw = dict(manual_seed=2, max_new_token=20, show_tqdm=False)
    a = ours.infer(["hello world"], use_velocity=False, skip_refine_text=True, split_text=False,
                   params_infer_code=ours.InferCodeParams(**kw))[0]
    b = up.infer(["hello world"], skip_refine_text=True, split_text=False,
                 params_infer_code=up.InferCodeParams(**kw))[0]
    assert a.shape == b.shape and a.size > 0
    assert float(abs(a - b).max()) <= 1e-5


def test_say_command_writes_a_wav(tiny_dir, tmp_path):
    out = tmp_path / "sub" / "out.wav"
    rc = main(["say", "Hello world. 你好。", "-o", str(out), "--model", str(tiny_dir), "--seed", "1",
               "--max-new-token", "20", "--random-speaker", "--no-refine"])
    assert rc == 0
    audio, sr = sf.read(out)
    assert sr == 24000 and audio.ndim == 1 and audio.size > 0


def test_say_command_reports_missing_weights(tmp_path, capsys):
    rc = main(["say", "hi", "-o", str(tmp_path / "x.wav"), "--model", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "nowhere" in err and "asset/gpt" in err and "--dummy" in err


def _hub_layout(src, hf_home, with_refs=True):
    repo = hf_home / "hub" / "models--2Noise--ChatTTS"
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(src, snap)
    if with_refs:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(snap.name)
    return snap


def _run_offline(hf_home, code):
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


LOAD_HF = ("from chattts_velocity import Chat; c = Chat(); c.load(source='huggingface', device='cpu'); "
           "print('ROOT', c.model.root); print('SPK', len(c.sample_random_speaker()))")


@pytest.mark.parametrize("with_refs", [True, False], ids=["refs", "snapshot-scan"])
def test_loads_from_hugging_face_cache_offline(tiny_dir, tmp_path, with_refs):
    snap = _hub_layout(tiny_dir, tmp_path, with_refs)
    res = _run_offline(tmp_path, LOAD_HF)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"ROOT {snap}" in res.stdout


def test_empty_hugging_face_cache_says_where_it_looked(tmp_path):
    res = _run_offline(tmp_path, LOAD_HF)
    assert res.returncode != 0
    assert "ModelNotFoundError" in res.stderr and str(tmp_path / "hub") in res.stderr
    assert "`hf download 2Noise/ChatTTS`" in res.stderr


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such folder: .*absent does not exist"):
        Chat().load(source="custom", custom_path=tmp_path / "absent", device="cpu")


def test_partial_folder_names_the_missing_file(tiny_dir, tmp_path):
    root = copy_ckpt(tiny_dir, tmp_path / "partial")
    os.remove(root / "asset" / "Vocos.safetensors")
    with pytest.raises(ModelNotFoundError, match="asset/Vocos.safetensors"):
        Chat().load(source="custom", custom_path=root, device="cpu")


@pytest.mark.parametrize("file,key,expected", [
    ("asset/Embed.safetensors", "emb_code.1.weight", r"Embed\.safetensors: emb_code\.1\.weight has shape"),
    ("asset/gpt/model.safetensors", "layers.1.mlp.up_proj.weight", r"gpt/\*\.safetensors: layers\.1\.mlp\.up_proj\.weight has shape \(129, 64\)"),
    # The conv's weight sets the inferred width, so its bias is the tensor that disagrees.
    ("asset/DVAE.safetensors", "decoder.conv_in.0.weight", r"DVAE\.safetensors: decoder\.conv_in\.0\.bias"),
    ("asset/Decoder.safetensors", "out_conv.weight", r"Decoder\.safetensors: .*out_conv\.weight"),
    ("asset/Vocos.safetensors", "backbone.embed.weight", r"Vocos\.safetensors: .*backbone\."),
])
def test_wrong_size_tensor_names_file_and_key(tiny_dir, tmp_path, file, key, expected):
    root = copy_ckpt(tiny_dir, tmp_path / "bad")
    sd = load_file(root / file)
    sd[key] = torch.zeros(sd[key].shape[0] + 1, *sd[key].shape[1:])
    save_file(sd, root / file)
    with pytest.raises(ValueError, match=expected):
        Chat().load(source="custom", custom_path=root, device="cpu")


def test_tokenizer_and_weights_must_match(tiny_dir, tmp_path):
    from chattts_velocity.model.tokenizer_files import write_tokenizer

    root = copy_ckpt(tiny_dir, tmp_path / "tok")
    shutil.rmtree(root / "asset" / "tokenizer")
    write_tokenizer(root / "asset" / "tokenizer", vocab_size=1000)
    with pytest.raises(ValueError, match="tokenizer has 1000 tokens"):
        Chat().load(source="custom", custom_path=root, device="cpu")


def test_checkpoint_without_speaker_stats_loads_but_cannot_sample(tiny_dir, tmp_path):
    root = copy_ckpt(tiny_dir, tmp_path / "nostat")
    os.remove(root / "asset" / "spk_stat.safetensors")
    chat = Chat()
    chat.load(source="custom", custom_path=root, device="cpu")
    with pytest.raises(ValueError, match="no speaker statistics"):
        chat.sample_random_speaker()


def test_dummy_weights_have_the_full_shapes():
    chat = Chat()
    chat.load(device="cpu", load_format="dummy")
    cfg = chat.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_text_tokens, cfg.num_audio_tokens) == (768, 20, 21178, 626)
    assert chat.model.tokenizer.len == 21178
    assert sum(p.numel() for p in chat.model.gpt.parameters()) > 150e6
    wavs = chat.infer(["hello"], skip_refine_text=True, split_text=False,
                      params_infer_code=chat.InferCodeParams(manual_seed=0, max_new_token=3, show_tqdm=False,
                                                             spk_emb=chat.sample_random_speaker()))
    assert wavs[0].dtype.name == "float32" and wavs[0].size > 0
    # the same construction as a loaded checkpoint: T tokens decode to (2T - 1) * 256 samples, not 512 T
    tokens = torch.zeros(5, cfg.hidden_size)
    assert chat.audio.to_wavs([tokens], use_decoder=True).shape == (1, (2 * 5 - 1) * 256)


def test_dummy_and_loaded_vocos_are_built_alike(tiny_dir):
    from chattts_velocity.audio import load_vocos
    from chattts_velocity.model.checkpoint import TINY, build_modules

    built = build_modules(TINY, 3, tokenizer_dir=str(tiny_dir / "tok")).vocos
    loaded = load_vocos(str(tiny_dir / "asset" / "Vocos.safetensors"), "cpu")
    mel = torch.randn(1, 100, 12)
    assert built.decode(mel).shape == loaded.decode(mel).shape == (1, 11 * 256)


def test_the_engine_and_the_reference_model_hold_the_fused_weights_once(chat):
    """In the core's dtype and device the transformers layers' q/k/v and gate/up weights are views of the
    engine's fused matrices (the others are the same tensors), so each weight is held once. A new engine over the
    same model (as other tests build) takes the views over, so this one is built here."""
    from chattts_velocity.engine import EngineConfig, LLMEngine

    with torch.inference_mode():  # as a caller may well build it
        core = LLMEngine.from_model(chat.model, EngineConfig(num_kv_blocks=16), "cpu").runner.core
    for hf, mine in zip(chat.model.gpt.llama.layers, core.layers, strict=True):
        att, mlp = hf.self_attn, hf.mlp
        for linears, fused in (([att.q_proj, att.k_proj, att.v_proj], mine.qkv), ([mlp.gate_proj, mlp.up_proj],
                                                                                   mine.gate_up)):
            stacked = torch.cat([m.weight for m in linears])
            assert torch.equal(stacked, fused)
            assert all(m.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for m in linears)
        assert att.o_proj.weight.data_ptr() == mine.o.data_ptr()
        assert mlp.down_proj.weight.data_ptr() == mine.down.data_ptr()
    # the views are ordinary tensors: the transformers model still runs outside inference mode once cast or moved
    mlp = chat.model.gpt.llama.layers[0].mlp.to(torch.float64)
    try:
        x = torch.randn(2, mlp.gate_proj.in_features, dtype=torch.float64)
        assert mlp(x).shape == x.shape
    finally:
        mlp.to(torch.float32)


def _reference_wav(chat, text="hello world"):
    torch.manual_seed(0)  # the speaker
    params = chat.InferCodeParams(spk_emb=chat.sample_random_speaker(), manual_seed=3, max_new_token=24)
    return chat.infer([text], params_infer_code=params, skip_refine_text=True, use_velocity=False)[0]


def test_an_engine_with_its_own_copy_lets_the_reference_weights_go_until_first_use(tiny_dir, tmp_path):
    """With the engine in float16 its core cannot share the float32 transformers weights: those are freed after
    the load and read again from the checkpoint by the first reference call, which then gives exactly the audio
    of a model that never let them go (the float32 engine shares them, so nothing is released there)."""
    from chattts_velocity import Chat

    ckpt = copy_ckpt(tiny_dir, tmp_path / "ckpt")
    kept, released = Chat(), Chat()
    kept.load(source="custom", custom_path=ckpt, device="cpu", num_kv_blocks=32)
    released.load(source="custom", custom_path=ckpt, device="cpu", num_kv_blocks=32, engine_dtype="float16")
    try:
        assert not kept.model.gpt.llama_released
        gpt = released.model.gpt
        assert gpt.llama_released
        assert all(p.numel() == 0 for p in gpt.llama.parameters())
        wav = _reference_wav(released)
        assert not gpt.llama_released
        for (name, mine), theirs in zip(gpt.llama.named_parameters(), kept.model.gpt.llama.parameters(),
                                        strict=True):
            assert torch.equal(mine, theirs), name
        np.testing.assert_array_equal(wav, _reference_wav(kept))
        # the velocity path never needed them
        assert released.infer(["hello"], skip_refine_text=True)[0].size > 0
    finally:
        kept.unload()
        released.unload()


def test_re_reading_released_weights_from_a_vanished_checkpoint_says_so(tiny_dir, tmp_path):
    from chattts_velocity import Chat

    ckpt = copy_ckpt(tiny_dir, tmp_path / "ckpt")
    chat = Chat()
    chat.load(source="custom", custom_path=ckpt, device="cpu", num_kv_blocks=32, engine_dtype="float16")
    try:
        shutil.rmtree(ckpt)
        with pytest.raises(RuntimeError, match="re-reading the reference model's weights"):
            _reference_wav(chat)
    finally:
        chat.unload()


def test_a_dummy_model_s_llama_weights_are_generated_again_the_same():
    import tempfile

    from chattts_velocity.model.checkpoint import TINY, build_modules, random_llama_state

    with tempfile.TemporaryDirectory() as tmp:
        mods = build_modules(TINY, 5, tokenizer_dir=tmp)
    again = random_llama_state(mods.config, 5)
    original = mods.gpt.llama.state_dict()
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)
