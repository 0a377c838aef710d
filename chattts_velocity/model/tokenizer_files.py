"""Write a ChatTTS-style ``BertTokenizerFast`` folder (for random checkpoints).

The real tokenizer has 21,178 entries; its control tags (``[Stts]``, ``[spk_emb]`` ...) are added tokens so they
are never split. Ids below ``[break_0]`` are kept in refined text (upstream drops ``id >= [break_0]``), so the
tags a refine pass may emit (``[uv_break]``, ``[laugh]``, ``[lbreak]``) come before it.
"""

from __future__ import annotations

import os
import string

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CONTROL_TAGS = ["[Stts]", "[spk_emb]", "[empty_spk]", "[Ptts]", "[Sbreak]", "[Pbreak]", "[Ebreak]"]
KEPT_TAGS = ["[uv_break]", "[v_break]", "[lbreak]", "[laugh]"]
PROMPT_TAGS = (
    [f"[break_{i}]" for i in range(8)]
    + [f"[speed_{i}]" for i in range(10)]
    + [f"[oral_{i}]" for i in range(10)]
    + [f"[laugh_{i}]" for i in range(3)]
)
# A small, fixed character set: ASCII letters/digits/punctuation, CJK punctuation and common Chinese characters.
_CJK = "，。、！？：；（）“”‘’的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坐集编宝谈府拉黑且随格尽剑讲布杀微怕母调局根曾准团段终乐切级克精哪官示冷域读"


def base_vocab() -> list[str]:
    """Every non-padding entry of the builder's vocabulary, in id order."""
    chars = list(dict.fromkeys(string.ascii_lowercase + string.digits + string.punctuation + _CJK))
    words = ["the", "and", "is", "to", "of", "a", "in", "it", "you", "that", "hello", "world", "speech", "text"]
    pieces = [f"##{c}" for c in string.ascii_lowercase + string.digits]
    vocab = BERT_SPECIALS + chars + words + pieces + CONTROL_TAGS + KEPT_TAGS + PROMPT_TAGS
    return list(dict.fromkeys(vocab))


def write_tokenizer(folder: str | os.PathLike, vocab_size: int | None = None) -> int:
    """Write ``tokenizer.json`` & co. into ``folder``; pad the vocabulary to ``vocab_size``. Returns its size."""
    from transformers import BertTokenizerFast

    vocab = base_vocab()
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"vocab_size must be at least {len(vocab)}, got {vocab_size}")
        vocab += [f"[unused{i}]" for i in range(vocab_size - len(vocab))]
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    core = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True, handle_chinese_chars=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok = BertTokenizerFast(tokenizer_object=core, do_lower_case=True)
    tok.add_special_tokens({"additional_special_tokens": CONTROL_TAGS + KEPT_TAGS + PROMPT_TAGS})
    os.makedirs(folder, exist_ok=True)
    tok.save_pretrained(folder)
    assert len(tok) == len(vocab), (len(tok), len(vocab))
    return len(tok)
