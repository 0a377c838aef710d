"""``Joiner``: the joins of a request's sentences (``faded``) for sentences whose end is learned late, sample for
sample, whatever the chunking."""

from __future__ import annotations

import numpy as np

from chattts_velocity.audio.joins import FADE, Joiner, faded


def chunked(rng: np.random.Generator, samples: np.ndarray) -> list[np.ndarray]:
    cuts = np.sort(rng.integers(0, samples.size + 1, size=rng.integers(0, 6)))
    return np.split(samples, cuts)  # empty chunks included


def test_joiner_equals_faded_over_the_sentences_for_any_chunking():
    rng = np.random.default_rng(0)
    for _ in range(500):
        sizes = rng.choice([0, 1, FADE // 2, FADE - 1, FADE, FADE + 1, 2 * FADE, 3 * FADE + 7, 1000],
                           size=rng.integers(1, 5))
        sentences = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        last = len(sentences) - 1
        want = np.concatenate([np.zeros(0, np.float32)] + [
            chunk for i, s in enumerate(sentences)
            for chunk in faded(iter(chunked(rng, s)), first=i == 0, last=i == last)])
        joiner, got = Joiner(), []
        for i, s in enumerate(sentences):
            if i:
                got.append(joiner.next_sentence())
            for chunk in chunked(rng, s):
                got.append(joiner.push(chunk))
                assert joiner.held <= max(FADE, s.size)
                assert got[-1].dtype == np.float32
        got.append(joiner.finish())
        assert joiner.held == 0
        np.testing.assert_array_equal(np.concatenate(got), want, err_msg=str(sizes))


def test_only_the_last_fade_is_held_back():
    joiner = Joiner()
    samples = np.ones(1000, np.float32)
    assert joiner.push(samples).size == 1000 - FADE and joiner.held == FADE
    tail = joiner.next_sentence()
    assert tail.size == FADE and tail[0] == 1 and tail[-1] == 0
    assert joiner.push(samples[: FADE - 1]).size == 0  # the fade-in waits for FADE samples
    out = joiner.push(samples)
    assert out[0] == 0 and out[FADE] == 1
    np.testing.assert_array_equal(joiner.finish(), samples[:FADE])  # the context's last: no fade-out
