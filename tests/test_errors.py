"""Bad input gets a clear ValueError before any work, not a traceback from deep inside."""

from __future__ import annotations

import pytest

from chattts_velocity import Chat, InferCodeParams, RefineTextParams


def quick(**kw):
    return InferCodeParams(**{"manual_seed": 0, "max_new_token": 8, "show_tqdm": False, **kw})


@pytest.mark.parametrize("text", ["", "   \n ", [], [""], ["ok", "  "], None, 3, ["ok", 5]])
def test_empty_or_non_text_input(chat, text):
    with pytest.raises(ValueError, match="empty|must be"):
        chat.infer(text, skip_refine_text=True, params_infer_code=quick())


def test_text_longer_than_context_without_splitting(chat):
    long_text = " ".join(["hello world"] * 400)
    with pytest.raises(ValueError, match=r"longer than the model's context: .* has \d+ tokens, the model holds 512"):
        chat.infer(long_text, skip_refine_text=True, split_text=False, params_infer_code=quick())


def test_long_text_is_split_to_fit_the_context(chat):
    long_text = " ".join(["hello world"] * 400)
    pieces = chat.prepare_texts(long_text, True, None, True, True)
    assert len(pieces) > 1
    assert all(chat.model.tokenizer.count(p) <= 256 for p in pieces)
    assert " ".join(p.strip() for p in pieces).split() == long_text.split()


def test_unbreakable_text_longer_than_context_is_cut_at_characters(chat):
    pieces = chat.prepare_texts("的" * 2000, True, None, True, True)
    assert "".join(pieces) == "的" * 2000 and len(pieces) == 8  # 2000 tokens in pieces of at most 256
    assert all(chat.model.tokenizer.count(p) <= 256 for p in pieces)


@pytest.mark.parametrize("field,value", [
    ("temperature", 0), ("temperature", -1.0), ("temperature", [0.3, 0.3]), ("temperature", "hot"),
    ("top_P", 0), ("top_P", 1.5), ("top_K", 0), ("top_K", 2.5), ("repetition_penalty", 0),
    ("max_new_token", 0), ("min_new_token", -1), ("min_new_token", 9), ("manual_seed", -1),
    ("stream_batch", 0), ("stream_speed", 0), ("pass_first_n_batches", -1), ("prompt", None),
])
def test_out_of_range_code_params(chat, field, value):
    with pytest.raises(ValueError, match=field):
        chat.infer("hello", skip_refine_text=True, params_infer_code=quick(**{field: value}))


@pytest.mark.parametrize("field,value", [("temperature", 0.0), ("top_P", 2.0), ("max_new_token", -3)])
def test_out_of_range_refine_params(chat, field, value):
    params = RefineTextParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        chat.infer("hello", params_refine_text=params, params_infer_code=quick())


@pytest.mark.parametrize("spk", ["not a speaker", "蜡烛", ""])
def test_malformed_speaker_string(chat, spk):
    with pytest.raises(ValueError, match="malformed speaker string"):
        chat.infer("hello", skip_refine_text=True, params_infer_code=quick(spk_emb=spk))


def test_speaker_of_another_model_size(chat):
    from chattts_velocity.text import SpeakerStats

    spk_768 = SpeakerStats.builtin_768().sample_random()
    with pytest.raises(ValueError, match="768"):
        chat.infer("hello", skip_refine_text=True, params_infer_code=quick(spk_emb=spk_768))


def test_malformed_voice_sample(chat):
    with pytest.raises(ValueError, match="spk_smp"):
        chat.infer("hello", skip_refine_text=True, params_infer_code=quick(spk_smp="garbage", txt_smp="x"))


def test_bad_lang_and_batch(chat):
    with pytest.raises(ValueError, match="lang"):
        chat.infer("hello", lang="fr", skip_refine_text=True, params_infer_code=quick())
    with pytest.raises(ValueError, match="max_split_batch"):
        chat.infer("hello", max_split_batch=0, skip_refine_text=True, params_infer_code=quick())


def test_infer_before_load():
    with pytest.raises(RuntimeError, match="load"):
        Chat().infer("hello")


def test_bad_source():
    with pytest.raises(ValueError, match="source"):
        Chat().load(source="ftp", device="cpu")
    with pytest.raises(ValueError, match="custom_path"):
        Chat().load(source="custom", device="cpu")
