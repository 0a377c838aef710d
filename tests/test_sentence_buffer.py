"""``SentenceBuffer``: ``split_text``'s sentences from text that arrives in pieces, whatever the cuts, and a
newline as one more sentence end."""

from __future__ import annotations

import random

from chattts_velocity.text.split import SentenceBuffer, split_text

ALPHABET = ["a", "b", " ", " ", ".", ".", "。", "3", "\t", "\u3000", "你", "!", ","]


def pieces(parts: list[str], end: bool = True) -> list[str]:
    buffer, got = SentenceBuffer(), []
    for part in parts:
        got += buffer.append(part)
    return got + buffer.flush() if end else got


def random_cuts(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_any_cuts_of_a_text_give_split_texts_pieces():
    rng = random.Random(0)
    for _ in range(1000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40)))
        want = split_text(text)
        # split_text drops empty pieces; only its last piece can be blank (every other ends with "。" or ". ")
        assert all(p.strip() for p in want[:-1]), text
        want = [p for p in want if p.strip()]
        cuts = random_cuts(rng, text)
        assert pieces(cuts) == want, cuts
        assert pieces(list(text)) == want, text
        assert pieces([text]) == want, text


def test_a_sentence_is_handed_out_the_moment_its_end_is_seen():
    buffer = SentenceBuffer()
    assert buffer.append("Pi is 3.") == [] and buffer.pending == 8  # a decimal point or a sentence end
    assert buffer.append("14. Next") == ["Pi is 3.14. "] and buffer.pending == 4
    assert buffer.append(" one.") == []
    assert buffer.append(" ") == ["Next one. "] and buffer.pending == 0
    assert buffer.append("你好。再见") == ["你好。"]
    assert buffer.flush() == ["再见"] and buffer.pending == 0
    assert buffer.flush() == []


def test_a_newline_ends_a_piece_and_is_dropped():
    assert pieces(["One\nTwo. Three.\n\n  \nFour。\nFive"]) == ["One", "Two. ", "Three.", "Four。", "Five"]
    assert pieces(list("a.\nb")) == ["a.", "b"]
    assert pieces(["a\n"], end=False) == ["a"]


def test_blank_text_gives_no_piece():
    buffer = SentenceBuffer()
    assert buffer.append("   ") == [] and buffer.pending == 3
    assert buffer.flush() == [] and buffer.pending == 0
    assert pieces(["Done. ", "  "]) == ["Done. "]
