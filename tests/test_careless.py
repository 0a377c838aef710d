"""Issue 13, "nothing silent, nothing wedged": the package tried as a careless user would. Each test is one fault
found that way: an input that wedged the engine, wrong audio without an error, an error naming internals, or a
first run that went badly."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import code_prompt, params

from chattts_velocity import Chat
from chattts_velocity.cli import build_parser, main
from chattts_velocity.engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from chattts_velocity.say import RANDOM_MAX_NEW_TOKEN
from chattts_velocity.text import encode_speaker, split_long


def quick(**kw):
    return Chat.InferCodeParams(**{"manual_seed": 0, "max_new_token": 8, "show_tqdm": False, **kw})


def infer_one(chat, text="hello", **kw):
    return chat.infer(text, skip_refine_text=True, split_text=False, params_infer_code=quick(**kw))


def engine_is_idle(chat) -> bool:
    engine = chat.engine
    if not engine.wait_idle(timeout=30):
        return False
    bm = engine.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


@pytest.fixture(scope="module")
def small_chat(upstream_ckpt):
    """One sequence at a time over a KV cache of 128 tokens (8 blocks of 16)."""
    chat = Chat()
    chat.load(source="custom", custom_path=upstream_ckpt, device="cpu", max_num_seqs=1, num_kv_blocks=8)
    yield chat
    chat.unload()


@pytest.fixture
def own_chat(upstream_ckpt):
    """A Chat of the test's own, for tests that reload or unload it."""
    chat = Chat()
    chat.load(source="custom", custom_path=upstream_ckpt, device="cpu")
    yield chat
    chat.unload()


@pytest.fixture
def ckpt_copy(upstream_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(upstream_ckpt, tmp_path / "ckpt"))


# ---------------------------------------------------------------- 1. no request wedges the engine
@pytest.mark.parametrize("kw,field", [
    ({"top_k": 2**63}, "top_k"), ({"top_k": 627}, "top_k"),  # 626 audio codes
    ({"min_new_tokens": 2**63, "max_new_tokens": 2**64}, "max_new_tokens"), ({"max_new_tokens": 2**63}, "max_new_tokens"),
])
def test_counts_beyond_what_the_engine_represents_are_rejected(chat, kw, field):
    engine = LLMEngine.from_model(chat.model, EngineConfig(), "cpu")
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.* is invalid"):
        engine.add_request("huge", code_prompt(chat, "hello"), params(**kw))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kw,field", [
    ({"top_K": 2**63}, "top_K"), ({"top_K": 627}, "top_K"), ({"stream_speed": 2**63}, "stream_speed"),
    ({"min_new_token": 2**63, "max_new_token": 2**64}, "max_new_token"),
])
def test_chat_params_beyond_what_the_engine_represents_are_rejected(chat, kw, field):
    with pytest.raises(ValueError, match=f"{field}=.* is out of range"):
        infer_one(chat, **kw)


def test_a_request_that_fails_inside_a_step_is_failed_alone_and_the_engine_serves_on(chat):
    engine = LLMEngine.from_model(chat.model, EngineConfig(num_decode_steps=1), "cpu")
    good = [code_prompt(chat, text) for text in ("one", "two")]
    for i, prompt in enumerate(good):
        engine.add_request(f"good{i}", prompt, params(min_new_tokens=6, max_new_tokens=6))
    poisoned = engine.make_sequence("poisoned", code_prompt(chat, "three"), params())
    poisoned.params = SamplingParams(top_k=2**63, seed=0)  # past validation, as before the bounds existed
    engine.add_sequence(poisoned)
    finals = {}
    for _ in range(100):
        finals.update({out.request_id: out for out in engine.step() if out.finished})
        if not engine.has_unfinished_requests():
            break
    assert finals["poisoned"].finish_reason is FinishReason.ERROR
    assert isinstance(finals["poisoned"].error, OverflowError)
    assert [finals[f"good{i}"].num_generated for i in range(2)] == [6, 6]
    engine.add_request("after", good[0], params(min_new_tokens=3, max_new_tokens=3))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].request_id == "after" and outs[-1].finish_reason is FinishReason.LENGTH
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---------------------------------------------------------------- 2. degenerate sampling
@pytest.mark.parametrize("use_velocity", [True, False])
@pytest.mark.parametrize("field,value,allowed", [
    ("temperature", 1e-50, r"\[1e-05, 100\]"), ("temperature", 1e6, r"\[1e-05, 100\]"),
    ("repetition_penalty", 1e-30, r"\[0.5, 10\]"), ("repetition_penalty", 1e6, r"\[0.5, 10\]"),
])
def test_degenerate_sampling_is_rejected_with_the_allowed_range(chat, use_velocity, field, value, allowed):
    with pytest.raises(ValueError, match=f"{field}=.* is out of range: must be a number in {allowed}"):
        chat.infer("hello", skip_refine_text=True, split_text=False, use_velocity=use_velocity,
                   params_infer_code=quick(**{field: value}))
    with pytest.raises(ValueError, match=allowed):
        SamplingParams(**{field: (value,) if field == "temperature" else value}).validate(4)


# ---------------------------------------------------------------- 3. text that normalises to nothing
@pytest.mark.parametrize("text", ["😀😀", "\u200b\u200b\x01", "مرحبا", "[laugh]、。"])
def test_text_with_nothing_readable_is_rejected_naming_it(chat, text, caplog):
    with caplog.at_level("WARNING"), pytest.raises(ValueError, match="nothing the model can read") as err:
        infer_one(chat, text)
    assert repr(text) in str(err.value)
    if text != "[laugh]、。":
        assert any("dropped characters the model cannot read" in r.message for r in caplog.records)
    with pytest.raises(ValueError, match=r"text\[1\] .*nothing the model can read"):
        chat.infer(["hello", text], skip_refine_text=True, params_infer_code=quick())


def test_a_sentence_with_nothing_readable_is_dropped_from_a_split_text(chat):
    assert chat.prepare_texts("Hello there. 😀😀. World", True, None, True, True) == ["Hello there. ", "World"]


# ---------------------------------------------------------------- 4. long text
@pytest.mark.parametrize("text", ["的" * 50_000, "的的的的，" * 10_000], ids=["no-break", "comma-every-5"])
def test_long_text_splits_in_linear_time_into_pieces_that_fit(chat, text):
    counted = []

    def count(piece: str) -> int:
        counted.append(len(piece))
        return chat.model.tokenizer.count(piece)

    start = time.perf_counter()
    pieces = split_long(text, count, 2048)
    assert "".join(pieces) == text
    assert all(chat.model.tokenizer.count(p) <= 2048 for p in pieces)
    assert len(pieces) <= 2 * len(text) // 2048 + 1
    assert sum(counted) <= 8 * len(text)  # each character counted a few times, not once per piece it joined
    assert time.perf_counter() - start < 30


def test_long_text_is_cut_at_a_sentence_end_before_a_later_comma():
    assert split_long("aaaaaaa. bb, c dddddd", len, 12) == ["aaaaaaa.", " bb,", " c dddddd"]


# ---------------------------------------------------------------- 5. a small KV cache cuts audio
def test_a_request_cut_by_the_kv_cache_finishes_saying_so(small_chat, caplog):
    prompt = code_prompt(small_chat, "a long speech")
    *_, final = small_chat.engine.add_request(prompt, params(min_new_tokens=300, max_new_tokens=300))
    assert final.finish_reason is FinishReason.CAPACITY and final.num_generated == 128 - prompt.ids.size(0)
    with caplog.at_level("WARNING", logger="chattts_velocity.pipeline"):
        wav = infer_one(small_chat, "a long speech", max_new_token=300, min_new_token=300)[0]
    assert wav.size > 0
    assert any("cut short" in r.message and "KV cache" in r.message for r in caplog.records)


# ---------------------------------------------------------------- 6. NaN and integer weights
@pytest.mark.parametrize("file,key,change,message", [
    ("asset/Decoder.safetensors", "out_conv.weight", "nan", r"Decoder\.safetensors: out_conv\.weight has 1 NaN"),
    ("asset/Embed.safetensors", "emb_text.weight", "inf", r"Embed\.safetensors: emb_text\.weight has 1 NaN or inf"),
    ("asset/gpt/model.safetensors", "norm.weight", "int",
     r"gpt/\*\.safetensors: norm\.weight has dtype torch\.int64, expected a floating-point tensor"),
    ("asset/Vocos.safetensors", "backbone.norm.weight", "int", r"Vocos\.safetensors: backbone\.norm\.weight has dtype"),
])
def test_bad_weights_are_rejected_at_load_naming_file_and_tensor(ckpt_copy, file, key, change, message):
    sd = load_file(ckpt_copy / file)
    if change == "int":
        sd[key] = sd[key].round().to(torch.int64)
    else:
        sd[key] = sd[key].clone()
        sd[key].view(-1)[0] = float(change)
    save_file(sd, ckpt_copy / file)
    with pytest.raises(ValueError, match=message):
        Chat().load(source="custom", custom_path=ckpt_copy, device="cpu")


@pytest.mark.parametrize("stream", [False, True])
def test_nan_samples_are_never_stripped_as_silence(chat, monkeypatch, caplog, stream):
    wav = np.array([np.nan, 0.0, 0.5, np.nan], dtype=np.float32)
    if stream:
        from chattts_velocity.audio.joins import aligned

        class Done:
            done = True

        chunk = aligned({"r": [wav]}, {"r": Done()}, ["r"])
        assert chunk.shape == (1, 3) and np.isnan(chunk).sum() == 2
        return
    monkeypatch.setattr(chat.pipeline, "speak", lambda texts, p, use_decoder: [wav.copy() for _ in texts])
    with caplog.at_level("WARNING"):
        (out,) = infer_one(chat)
    assert out.size == 3 and np.isnan(out).sum() == 2  # the silent sample goes, the NaN ones stay
    assert any("2 NaN or infinite samples" in r.message for r in caplog.records)


# ---------------------------------------------------------------- 7. a failed re-load
def test_a_failed_reload_leaves_the_previous_model_loaded_and_usable(own_chat, ckpt_copy):
    before = infer_one(own_chat)[0]
    model, engine = own_chat.model, own_chat.engine
    config = json.loads((ckpt_copy / "asset/gpt/config.json").read_text())
    (ckpt_copy / "asset/gpt/config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    with pytest.raises(ValueError, match="holds no KV block"):
        own_chat.load(source="custom", custom_path=ckpt_copy, device="cpu", kv_cache_gib=1e-9)
    assert own_chat.model is model and own_chat.engine is engine
    assert own_chat.model.config.max_position_embeddings == 512
    np.testing.assert_array_equal(infer_one(own_chat)[0], before)


# ---------------------------------------------------------------- 8. streams and interrupts
def test_stream_with_more_texts_than_sequences_interrupted_frees_everything(small_chat, monkeypatch):
    pump = small_chat.pipeline.pump
    decode = pump.decode

    def interrupt_at_first_audio(windows, use_decoder):
        small_chat.interrupt()  # the first text has audio; the others wait (one sequence at a time), no tokens
        return decode(windows, use_decoder)

    monkeypatch.setattr(pump, "decode", interrupt_at_first_audio)
    chunks = list(small_chat.infer(["one text", "two text", "three"], stream=True, skip_refine_text=True,
                                   split_text=False, params_infer_code=quick(max_new_token=60, min_new_token=60)))
    assert chunks and all(chunk.shape[0] == 3 for chunk in chunks)
    assert not chunks[-1][1:].any()  # the texts that never started are silent rows
    assert engine_is_idle(small_chat)


def test_a_stream_that_fails_frees_its_requests(small_chat, monkeypatch):
    def broken(windows, use_decoder):
        raise RuntimeError("decoder failed")

    monkeypatch.setattr(small_chat.pipeline.pump, "decode", broken)
    gen = small_chat.infer(["one text", "two"], stream=True, skip_refine_text=True, split_text=False,
                           params_infer_code=quick(max_new_token=200, min_new_token=200))
    with pytest.raises(RuntimeError, match="decoder failed") as kept:  # the exception (and its frames) live on
        list(gen)
    assert engine_is_idle(small_chat) and kept.value is not None


@pytest.mark.parametrize("use_velocity", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_interrupt_during_refine_ends_the_call_without_audio_and_says_why(chat, monkeypatch, caplog, use_velocity,
                                                                          stream):
    path = chat.pipeline if use_velocity else chat.reference
    refine = path.refine

    def interrupted_refine(texts, p):
        out = refine(texts, p)
        chat.interrupt()  # as if it came from another thread while refining
        return out

    monkeypatch.setattr(path, "refine", interrupted_refine)
    kw = dict(params_refine_text=Chat.RefineTextParams(manual_seed=0, max_new_token=4, show_tqdm=False),
              params_infer_code=quick(), split_text=False, use_velocity=use_velocity, stream=stream)
    with caplog.at_level("WARNING", logger="chattts_velocity.chat"):
        out = list(chat.infer(["hello there"], **kw))
    assert [w.size for w in out] == ([] if stream else [0])
    assert any("interrupted before its audio pass" in r.message for r in caplog.records)


# ---------------------------------------------------------------- 9. errors that named internals
@pytest.mark.parametrize("use_velocity", [True, False])
def test_a_speaker_string_of_zeros_is_no_speaker(chat, use_velocity):
    zeros = encode_speaker(torch.zeros(chat.model.config.hidden_size))
    with pytest.raises(ValueError, match="all zeros .* which is no speaker; use one from Chat.sample_random_speaker"):
        chat.infer("hello", skip_refine_text=True, split_text=False, use_velocity=use_velocity,
                   params_infer_code=quick(spk_emb=zeros))


def test_numpy_numbers_are_numbers(chat):
    plain = infer_one(chat, temperature=0.3, top_K=20, top_P=0.7, max_new_token=8, manual_seed=3)[0]
    numpy = infer_one(chat, temperature=np.float32(0.3), top_K=np.int64(20), top_P=np.float64(0.7),
                      max_new_token=np.int64(8), manual_seed=np.uint32(3))[0]
    np.testing.assert_array_equal(plain, numpy)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_P", "max_new_token", "manual_seed"])
def test_huge_numbers_are_out_of_range_not_overflow(chat, field):
    with pytest.raises(ValueError, match=rf"{field}=\d+\.\.\.\(401 characters\) is out of range"):
        infer_one(chat, **{field: 10**400})


@pytest.mark.parametrize("name", ["params_infer_code", "params_refine_text"])
def test_params_as_a_dict_say_how_to_build_them(chat, name):
    cls = "InferCodeParams" if name == "params_infer_code" else "RefineTextParams"
    with pytest.raises(TypeError, match=rf"{name} must be a Chat\.{cls}, got dict: build one with Chat\.{cls}\("):
        chat.infer("hello", **{name: {"temperature": 0.3}})


def test_config_json_of_the_wrong_type_names_the_file(ckpt_copy):
    path = ckpt_copy / "asset/gpt/config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "hidden_size": "64"}))
    with pytest.raises(ValueError, match=r"asset/gpt/config\.json: GPT config: hidden_size must be a positive int, "
                                         r"got '64'"):
        Chat().load(source="custom", custom_path=ckpt_copy, device="cpu")


def test_unload_during_infer_is_a_clear_error(own_chat):
    errors = []

    def speak():
        try:
            infer_one(own_chat, max_new_token=400, min_new_token=400)
        except Exception as e:  # noqa: BLE001 - the test inspects whatever came out
            errors.append(e)

    engine = own_chat.engine.engine
    worker = threading.Thread(target=speak)
    worker.start()
    for _ in range(3000):
        if engine.requests:
            break
        time.sleep(0.01)
    own_chat.unload()
    worker.join(60)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "unloaded during this infer call" in str(errors[0])
    with pytest.raises(RuntimeError, match=r"no model loaded: call Chat\.load\(\) first"):
        infer_one(own_chat)


# ---------------------------------------------------------------- 10. first run of the command line
def test_cli_device_that_does_not_exist_says_what_does(ckpt_copy, tmp_path, capsys):
    out = str(tmp_path / "x.wav")
    assert main(["say", "hi", "--model", str(ckpt_copy), "--device", "gpu", "-o", out]) == 2
    assert "unknown device 'gpu': devices here are cpu" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["say", "hi", "--model", str(ckpt_copy), "--device", "cuda", "-o", out]) == 2
        assert "CUDA is not available on this machine" in capsys.readouterr().err


def test_cli_ctrl_c_says_interrupted_and_exits_130_without_a_traceback(upstream_ckpt, tmp_path, capsys,
                                                                       monkeypatch):
    def ctrl_c(self, *args, **kw):
        raise KeyboardInterrupt  # as Ctrl-C lands in the main thread while the passes run

    monkeypatch.setattr(Chat, "infer", ctrl_c)
    out = tmp_path / "x.wav"
    assert main(["say", "hi", "--model", upstream_ckpt, "--device", "cpu", "-o", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert not out.exists()


def test_cli_unwritable_output_fails_before_loading(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    rc = main(["say", "hi", "--model", str(tmp_path / "nowhere"), "-o", str(tmp_path / "a_file" / "out.wav")])
    assert rc == 2
    assert "cannot write" in capsys.readouterr().err  # not the missing model: nothing was loaded


def test_cli_missing_model_folder_says_no_such_folder_and_how_to_download(tmp_path, capsys):
    assert main(["say", "hi", "--model", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err
    assert f"no such folder: {tmp_path / 'nowhere'} does not exist" in err
    assert "`hf download 2Noise/ChatTTS`" in err and "huggingface-cli" not in err


def test_cli_say_dummy_is_short_by_default_and_threads_are_set(upstream_ckpt, tmp_path, capsys, monkeypatch):
    real_load, seen = Chat.load, {}

    def tiny_instead_of_dummy(self, *args, load_format="safetensors", **kw):
        seen["load_format"] = load_format  # the full-size random model takes minutes on a CPU: the tiny one
        return real_load(self, source="custom", custom_path=upstream_ckpt, device="cpu")

    real_infer = Chat.infer

    def spy(self, text, **kw):
        seen["code"], seen["refine"] = kw["params_infer_code"], kw["params_refine_text"]
        return real_infer(self, text, **kw)

    monkeypatch.setattr(Chat, "load", tiny_instead_of_dummy)
    monkeypatch.setattr(Chat, "infer", spy)
    threads = torch.get_num_threads()
    try:
        assert main(["say", "Hello there.", "--dummy", "--threads", "1", "-o", str(tmp_path / "d.wav")]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert seen["load_format"] == "dummy"
    assert seen["code"].max_new_token == seen["refine"].max_new_token == RANDOM_MAX_NEW_TOKEN
    assert f"each pass stops at {RANDOM_MAX_NEW_TOKEN} tokens" in capsys.readouterr().out


def test_cli_version_and_help_without_backticks(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip().startswith("chattts-velocity 0.")
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in [("", parser), *subparsers.items()]:
        assert "``" not in sub.format_help(), name
    assert "--threads" in subparsers["say"].format_help() and "--threads" in subparsers["serve"].format_help()


# ---------------------------------------------------------------- 11. bench
def test_matplotlib_is_in_the_dev_and_bench_extras():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert any(dep.startswith("matplotlib") for dep in extras["dev"])
    assert any(dep.startswith("matplotlib") for dep in extras["bench"])
