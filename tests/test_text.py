"""Parity of ``chattts_velocity.text`` with upstream ChatTTS (package ``chattts``) on CPU."""

from __future__ import annotations

import copy
import lzma
import os
import random
import re
import struct

import ChatTTS
import numpy as np
import pybase16384 as b14
import pytest
import torch
import torch.nn.functional as F
from ChatTTS.config.config import Config
from ChatTTS.model.speaker import Speaker
from ChatTTS.model.tokenizer import Tokenizer as UpTokenizer
from ChatTTS.norm import Normalizer as UpNormalizer

from chattts_velocity.model.tokenizer_files import write_tokenizer
from chattts_velocity.text import (
    Normalizer,
    SpeakerStats,
    Tokenizer,
    apply_speaker,
    decode_prompt,
    decode_speaker,
    decorate_code_prompts,
    decorate_text_prompts,
    encode_prompt,
    encode_speaker,
    speaker_vector,
    split_long,
    split_text,
)

UPSTREAM_MAP = os.path.join(os.path.dirname(ChatTTS.__file__), "res", "homophones_map.json")
RAW_LZMA = {"format": lzma.FORMAT_RAW, "filters": [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]}
NUM_VQ = 4

TEXTS = [
    "",
    "你好，世界。今天天气怎么样？",
    "四川美食确实以辣闻名，但也有不辣的选择。比如甜水面、赖汤圆、蛋烘糕、叶儿粑等，这些小吃口味温和。",
    "Hello world! This is a test: (really) <ok> - fine; yes.",
    "ChatTTS 是一个 text-to-speech 模型, 支持 English 和中文!",
    "你好[uv_break]世界[laugh]，哈哈[lbreak]",
    "hello [uv_break] world [laugh]!",
    "价格是$100 & 50% off? email@example.com #tag ~ `code` {x|y} \\ ^",
    "数字 3.14 和 1,000,000 以及 A+B=C",
    "😀 emoji 你好！🎉",
    "全角：；！（）【】『』「」《》－ 半角:;!()<>-",
    "unclosed [tag 你好@",
    "stray ] bracket 你好]世界@",
    "nested [a[b]c] 你好@",
    "a]b[x]c 中文@",
    "[Stts][spk_emb] tags only [Ptts]",
    "\t换行\n和制表符\r",
    "日本語のテキストとカタカナ",
    "Ελληνικά и кириллица",
    "行长在银行行走，重庆的重要性。",
]


@pytest.fixture(scope="module")
def norms() -> tuple[Normalizer, UpNormalizer]:
    return Normalizer(), UpNormalizer(UPSTREAM_MAP)


def _fuzz_texts(n: int, seed: int = 0) -> list[str]:
    import json

    with open(UPSTREAM_MAP, encoding="utf-8") as f:
        homophones = list(json.load(f))[:200]
    alphabet = (homophones + list("你好世界中文的一是") + list("abcXYZ09") + list(" .,!?;:()<>-[]_[]@#$%&*\"'\t")
                + list("，。！？；：（）【】《》、") + ["😀", "é", "ß", "[uv_break]", "[laugh]"])  # fmt: skip
    rng = random.Random(seed)
    return ["".join(rng.choices(alphabet, k=rng.randint(1, 30))) for _ in range(n)]


@pytest.mark.parametrize("lang", [None, "zh", "en"])
@pytest.mark.parametrize("do_norm", [True, False])
@pytest.mark.parametrize("do_homo", [True, False])
def test_normalizer_matches_upstream(norms, lang, do_norm, do_homo):
    ours, up = norms
    for text in TEXTS + _fuzz_texts(150):
        assert ours(text, do_norm, do_homo, lang) == up(text, do_norm, do_homo, lang), repr(text)


def test_normalizer_really_changes_text(norms):
    ours, _ = norms
    assert ours("Hello, world!", lang="zh") == "Hello， world。"
    assert ours("你好@世界!") == "你好世界。"
    assert ours("hi [uv_break] there!") == "hi [uv_break] there."
    text = "行长在银行行走，重庆的重要性。" + "".join(_fuzz_texts(20))
    assert ours(text, do_homophone_replacement=True) != ours(text, do_homophone_replacement=False)


def test_registered_normalizers_match_upstream():
    ours, up = Normalizer(), UpNormalizer(UPSTREAM_MAP)
    for n in (ours, up):
        assert n.register("en", str.upper)
        assert n.register("zh", lambda s: s.replace("1", "一") + "|")
    # upstream raises IndexError on "" once a normaliser is registered; we return ""
    assert ours("", lang="en") == ""
    for text in [t for t in TEXTS if t] + _fuzz_texts(150, seed=1) + ["1个[uv_break]2个", "a[x]]b"]:
        for lang in (None, "zh", "en"):
            assert ours(text, lang=lang) == up(text, lang=lang), repr(text)
    ours.unregister("en")
    ours.unregister("missing")
    assert ours("hello [uv_break] world", lang="en") == "hello [uv_break] world"


def test_register_refuses_bad_normalizers():
    n = Normalizer()
    assert n.register("en", str.upper)
    assert not n.register("en", str.lower)
    assert not n.register("zh", lambda s: 1 / 0)
    assert not n.register("zh", lambda s: len(s))
    assert n("abc", lang="en") == "ABC"
    assert n("abc", lang="zh") == "abc"


def test_split_text():
    assert split_text("你好。世界。") == ["你好。", "世界。"]
    assert split_text("Hello. World. 3.14 is pi.") == ["Hello. ", "World. ", "3.14 is pi."]
    assert split_text("第一句。\n第二句。第三句") == ["第一句。", "第二句。第三句"]
    assert split_text("a\n\nb\n") == ["a", "", "b", ""]
    assert split_text("。。") == ["。", "。"]
    assert split_text("no break here") == ["no break here"]
    assert split_text("") == []


def test_split_long_by_characters():
    text = "aaaa. bbbb. cccc, dddd eeee"
    pieces = split_long(text, len, 8)
    assert pieces == ["aaaa.", " bbbb.", " cccc,", " dddd ", "eeee"]
    assert split_long("short。", len, 8) == ["short。"]
    assert split_long("一二三。四五。六七八九十一二。", len, 8) == ["一二三。四五。", "六七八九十一二。"]


def test_split_long_with_tokenizer(tok_dir):
    tok = Tokenizer(tok_dir)
    text = "今天天气很好，我们去公园散步吧！" * 6 + "hello world, this is speech text. " * 4
    pieces = split_long(text, tok.count, 20)
    assert len(pieces) > 1 and "".join(pieces) == text
    assert all(tok.count(p) <= 20 for p in pieces)


def test_a_token_covers_at_least_one_character(tok_dir):
    """What lets ``prepare_texts`` skip counting a text no longer than its token limit in characters."""
    tok = Tokenizer(tok_dir)
    for text in ["hello world", "今天天气很好", "naïve café", "ﬁne ﬀ", "emoji 😀🎉", "[uv_break] and [laugh]", "a" * 50,
                 "x", "¼ ½ ² ³", "Ⅻ ㎏ ㍻", "ｆｕｌｌ", "\u0301\u0301 combining", "tab\tnew\nline", "١٢٣", "क्षत्रिय"]:
        assert tok.count(text) <= len(text), text


def test_split_long_cuts_unbreakable_runs_at_characters():
    assert split_long("ok. abcdefghijk", len, 8) == ["ok. ", "abcdefgh", "ijk"]
    tags_as_one = lambda text: len(re.sub(r"\[\w+\]", "#", text))  # noqa: E731 - as the tokenizer counts them
    assert split_long("[uv_break][laugh]abc", tags_as_one, 2) == ["[uv_break][laugh]", "ab", "c"]  # tags stay whole
    with pytest.raises(ValueError, match="max_tokens"):
        split_long("abc", len, 0)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("tokenizer"))
    write_tokenizer(folder)
    return folder


BATCHES = [
    ["hello world"],
    ["[Stts][spk_emb]你好，世界。[Ptts]", "a", "the speech text is hello 的一是 [uv_break] xyz!"],
    ["", "short", "[Sbreak]long 长 long 长 long 长[Pbreak][break_6]"],
]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("prompt_len", [0, 1, 7])
def test_tokenizer_encode_matches_upstream(tok_dir, batch, prompt_len):
    ours, up = Tokenizer(tok_dir), UpTokenizer(tok_dir)
    prompt = torch.randint(0, 626, (NUM_VQ, prompt_len), dtype=torch.int32) if prompt_len else None
    got = ours.encode(list(batch), NUM_VQ, prompt=prompt)
    want = up.encode(list(batch), NUM_VQ, prompt=prompt)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)
    if prompt_len:
        assert torch.equal(got[0][0, -prompt_len:], prompt.t().long()) and not got[2][:, -prompt_len:].any()


def test_tokenizer_attributes_decode_count(tok_dir):
    ours, up = Tokenizer(tok_dir), UpTokenizer(tok_dir)
    assert (ours.len, ours.spk_emb_ids, ours.break_0_ids, ours.eos_token) == (
        up.len, up.spk_emb_ids, up.break_0_ids, up.eos_token)  # fmt: skip
    assert len({ours.spk_emb_ids, ours.break_0_ids, ours.eos_token}) == 3
    seqs = [torch.tensor([5, 6, 7, ours.spk_emb_ids]), torch.tensor([100, 101])]
    assert ours.decode(seqs) == up.decode(seqs) and ours.decode([[5, 6]]) == up.decode([[5, 6]])
    for text in ["hello world", "你好[uv_break]世界", ""]:
        assert ours.count(text) == up.encode([text], 1)[0].shape[1]


def test_tokenizer_errors(tok_dir, tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer(tmp_path)
    with pytest.raises(ValueError, match="num_vq"):
        Tokenizer(tok_dir).encode(["a"], NUM_VQ, prompt=torch.zeros(NUM_VQ - 1, 3, dtype=torch.int32))


@pytest.fixture(scope="module")
def up_speaker() -> Speaker:
    return Speaker(768, Config().spk_stat)


def test_builtin_stats_and_random_speakers_match_upstream(up_speaker):
    stats = SpeakerStats.builtin_768()
    assert stats.dim == 768 and stats.std.dtype == torch.float16
    assert torch.equal(stats.std, up_speaker.std) and torch.equal(stats.mean, up_speaker.mean)
    for seed in (0, 1, 1234):
        torch.manual_seed(seed)
        want = up_speaker.sample_random()
        torch.manual_seed(seed)
        assert stats.sample_random() == want
    assert stats.sample_random() != want
    gen = torch.Generator().manual_seed(7)
    assert torch.equal(stats.sample(gen), stats.sample(torch.Generator().manual_seed(7)))


def test_speaker_strings_round_trip_both_ways(up_speaker):
    torch.manual_seed(3)
    vec = up_speaker._sample_random()
    s = encode_speaker(vec)
    assert s == Speaker._encode(vec)
    assert s == encode_speaker(vec.float())
    back = decode_speaker(s, dim=768)
    assert back.dtype == torch.float16 and torch.equal(back, torch.from_numpy(Speaker._decode(s)))
    assert torch.equal(back, vec) and torch.equal(decode_speaker(s + "\n"), vec)


def _b14_lzma(raw: bytes) -> str:
    return b14.encode_to_string(lzma.compress(raw, **RAW_LZMA))


def test_malformed_speaker_strings(up_speaker):
    good = up_speaker.sample_random()
    bad = [
        123,
        None,
        "",
        "hello world",
        good[:-7],
        good[:10] + "x" + good[10:],
        b14.encode_to_string(b"not lzma at all, just bytes"),
        _b14_lzma(b"\x00\x3c\x00"),  # odd byte count
        _b14_lzma(np.array([1.0, np.inf], dtype="<f2").tobytes()),
        b14.encode_to_string(b14.decode_from_string(good) + b"\x07junk"),
    ]
    for s in bad:
        with pytest.raises(ValueError, match="malformed speaker string"):
            decode_speaker(s)
    with pytest.raises(ValueError, match="768 values but this model's speakers have 512"):
        decode_speaker(good, dim=512)
    with pytest.raises(ValueError):
        encode_speaker(torch.zeros(2, 3))


def test_prompt_strings_round_trip_both_ways():
    codes = torch.randint(0, 626, (NUM_VQ, 37), dtype=torch.int32)
    s = encode_prompt(codes)
    assert s == Speaker.encode_prompt(codes)
    assert s == encode_prompt(codes.long())
    back = decode_prompt(Speaker.encode_prompt(codes), num_vq=NUM_VQ, num_codes=626)
    want = Speaker.decode_prompt(s)
    assert back.dtype == want.dtype == torch.int32 and back.shape == (NUM_VQ, 37)
    assert torch.equal(back, want) and torch.equal(back, codes)


def test_malformed_prompt_strings():
    codes = torch.randint(0, 626, (NUM_VQ, 37), dtype=torch.int32)
    good = encode_prompt(codes)
    raw = lzma.compress(codes.numpy().astype("<u2").tobytes(), **RAW_LZMA)
    cases = [
        (42, {}),
        ("not base16384", {}),
        (b14.encode_to_string(b"\x04\x00"), {}),
        (b14.encode_to_string(struct.pack("<2H", NUM_VQ, 38) + raw), {}),  # header disagrees with data
        (b14.encode_to_string(struct.pack("<2H", NUM_VQ, 37) + b"\x01\x02garbage"), {}),
        (b14.encode_to_string(struct.pack("<2H", NUM_VQ, 0)), {}),
        (good, {"num_vq": NUM_VQ + 1}),
        (good, {"num_codes": int(codes.max())}),
    ]
    for s, kwargs in cases:
        with pytest.raises(ValueError, match=r"malformed voice sample \(spk_smp\) string"):
            decode_prompt(s, **kwargs)
    for bad in (torch.zeros(3), torch.zeros(2, 2), torch.full((2, 2), 70000), torch.full((2, 2), -1)):
        with pytest.raises(ValueError):
            encode_prompt(bad)


@pytest.mark.parametrize("prompt", ["", "[speed_5]"])
@pytest.mark.parametrize("txt_smp", [None, "样本文本"])
@pytest.mark.parametrize("has_spk", [True, False])
def test_decorate_prompts_match_upstream_without_mutating(prompt, txt_smp, has_spk):
    texts = ["  你好 ", "[Stts][spk_emb]hi[empty_spk]", "[St[spk_emb]ts]x", "plain"]
    before = list(texts)
    spk = "spk" if has_spk else None
    assert decorate_code_prompts(texts, prompt, txt_smp, has_spk) == Speaker.decorate_code_prompts(
        copy.copy(texts), prompt, txt_smp, spk)  # fmt: skip
    assert decorate_text_prompts(texts, prompt) == Speaker.decorate_text_prompts(copy.copy(texts), prompt)
    assert texts == before


def test_speaker_vector_and_apply_match_upstream(up_speaker, tok_dir):
    tok = Tokenizer(tok_dir)
    batch = decorate_code_prompts(["你好世界", "hello"], "", None, True)
    batch[1] = batch[1].replace("[spk_emb]", "[empty_spk]")
    input_ids, _, _ = tok.encode(batch, NUM_VQ)
    emb = torch.randn(*input_ids.shape[:2], 768)
    torch.manual_seed(11)
    spk = up_speaker.sample_random()
    want = up_speaker.apply(emb.clone(), spk, input_ids, tok.spk_emb_ids, torch.device("cpu"))
    for source in (spk, decode_speaker(spk)):
        vec = speaker_vector(source, 768)
        assert torch.equal(vec, F.normalize(decode_speaker(spk), p=2.0, dim=0, eps=1e-12))
        got = apply_speaker(emb.clone(), input_ids, tok.spk_emb_ids, vec)
        assert torch.equal(got, want)
    assert not torch.equal(want, emb) and (want != emb).any(-1).sum() == 1
    for bad in (spk[:-3], torch.zeros(767), torch.full((768,), float("nan")), 5):
        with pytest.raises(ValueError):
            speaker_vector(bad, 768)


def test_a_speaker_string_is_decoded_once_and_copied_out():
    """``speaker_vector`` of a string is cached (a server's voices come back with every request): equal
    vectors, never the same tensor (a caller may write to its copy); a bad string raises every time."""
    from chattts_velocity.text import speaker_vector
    from chattts_velocity.text.speaker import _string_speaker, encode_speaker

    spk = encode_speaker(torch.randn(16, generator=torch.Generator().manual_seed(3)))
    _string_speaker.cache_clear()
    a, b = speaker_vector(spk, 16), speaker_vector(spk, 16)
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    a.zero_()
    assert torch.equal(speaker_vector(spk, 16), b)
    assert _string_speaker.cache_info().hits == 2
    for _ in range(2):
        with pytest.raises(ValueError):
            speaker_vector(spk, 32)
