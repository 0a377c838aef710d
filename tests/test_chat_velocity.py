"""``Chat.infer(use_velocity=True)`` (the default): the engine behind the ChatTTS API, against the reference
path, with its own guarantees (each text independent of its neighbours, decoded at its own length)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_velocity import Chat
from chattts_velocity.audio import StreamConfig

TEXTS = ["hello world, the text is short", "你好，是的。speech", "a b c"]
ARGMAX = dict(temperature=1e-4, manual_seed=0, show_tqdm=False)


def engine_is_idle(chat) -> bool:
    assert chat.engine.wait_idle(timeout=30)
    stats = chat.engine.stats().engine
    return stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_velocity_codes_equal_reference_under_argmax(chat):
    p = Chat.InferCodeParams(max_new_token=30, min_new_token=5, **ARGMAX)
    fast = chat.pipeline.codes(list(TEXTS), p)
    ref = list(chat.reference.infer_code(list(TEXTS), False, p))[-1]
    for i, (a, b) in enumerate(zip(fast, ref.ids, strict=True)):
        assert torch.equal(a.ids, b), f"text {i}: codes differ"
    for i, (a, b) in enumerate(zip(fast, ref.hiddens, strict=True)):
        assert (a.hidden - b).abs().max().item() <= 1e-4, f"text {i}: hidden states differ"
    assert engine_is_idle(chat)


def test_velocity_refine_equals_reference_under_argmax(chat):
    p = Chat.RefineTextParams(max_new_token=16, **ARGMAX)
    fast = chat.infer(list(TEXTS), refine_text_only=True, split_text=False, params_refine_text=p)
    ref = chat.infer(list(TEXTS), refine_text_only=True, split_text=False, params_refine_text=p, use_velocity=False)
    assert fast == ref and all(isinstance(t, str) for t in fast)


@pytest.mark.parametrize("use_decoder", [True, False])
def test_each_text_is_independent_of_its_neighbours(chat, use_decoder):
    p = Chat.InferCodeParams(manual_seed=9, max_new_token=40, show_tqdm=False)
    kw = dict(skip_refine_text=True, split_text=False, use_decoder=use_decoder, params_infer_code=p)
    together = chat.infer(list(TEXTS), **kw)
    for i, text in enumerate(TEXTS):
        alone = chat.infer([text], **kw)[0]
        assert together[i].shape == alone.shape, f"text {i}: length depends on the other texts"
        if use_decoder:  # hidden states carry the batch's float rounding (~1e-6); the codes are identical
            assert np.allclose(together[i], alone, atol=1e-4), f"text {i}: audio depends on the other texts"
        else:
            assert np.array_equal(together[i], alone), f"text {i}: audio depends on the other texts"
    assert len({w.size for w in together}) > 1, "texts should end at their own lengths"


def test_velocity_pipeline_with_refine_split_and_speaker(chat):
    spk = chat.sample_random_speaker()
    wavs = chat.infer("First sentence here. 第二句话。Third one!", params_infer_code=Chat.InferCodeParams(
        spk_emb=spk, manual_seed=1, max_new_token=24, show_tqdm=False),
        params_refine_text=Chat.RefineTextParams(manual_seed=1, max_new_token=12, show_tqdm=False))
    assert len(wavs) == 1 and wavs[0].dtype == np.float32 and wavs[0].size > 0
    assert engine_is_idle(chat)


def test_velocity_stream_matches_the_offline_call(chat):
    p = Chat.InferCodeParams(manual_seed=2, max_new_token=60, min_new_token=60, show_tqdm=False)
    kw = dict(skip_refine_text=True, split_text=False, params_infer_code=p)
    offline = chat.infer(["stream this text"], **kw)[0]
    chunks = list(chat.infer(["stream this text"], stream=True, **kw))
    cfg = chat.pipeline.stream_config
    # the first chunk holds first_chunk tokens of audio; then one chunk per `chunk` tokens, then the tail
    assert chunks[0].shape[0] == 1 and chunks[0].shape[1] <= cfg.first_chunk * 512
    assert len(chunks) >= 1 + (60 - cfg.first_chunk - cfg.lookahead) // cfg.chunk
    streamed = np.concatenate(chunks, axis=1)[0]
    # a bounded context moves samples near the silence threshold, which both paths drop
    assert abs(streamed.size - offline.size) <= 16 and offline.size > 50 * 480
    exact = StreamConfig(left_context=52, lookahead=52, first_chunk=8, chunk=24)
    saved, chat.pipeline.stream_config = chat.pipeline.stream_config, exact
    try:
        streamed = np.concatenate(list(chat.infer(["stream this text"], stream=True, **kw)), axis=1)[0]
    finally:
        chat.pipeline.stream_config = saved
    assert streamed.shape == offline.shape and np.allclose(streamed, offline, atol=1e-5)


def test_abandoned_stream_leaves_the_engine_clean(chat):
    p = Chat.InferCodeParams(manual_seed=2, max_new_token=80, min_new_token=80, stream_batch=4,
                             pass_first_n_batches=0, show_tqdm=False)
    gen = chat.infer(["stop listening early"], stream=True, skip_refine_text=True, split_text=False,
                     params_infer_code=p)
    next(gen)
    gen.close()
    assert engine_is_idle(chat)


def test_engine_settings_on_load(upstream_ckpt):
    chat = Chat()
    chat.load(source="custom", custom_path=upstream_ckpt, device="cpu", block_size=8, num_kv_blocks=40,
              max_num_seqs=2, max_num_batched_tokens=32, enable_prefix_caching=False, open_window_max_seqs=0,
              window_stops=(16, 24), window_budget_ms=None)
    engine = chat.engine.engine
    assert engine.block_manager.num_blocks == 40 and engine.block_manager.block_size == 8
    assert engine.config.open_window_max_seqs == 0 and engine.arrivals is not None  # (set by the async engine)
    assert engine.scheduler.max_num_seqs == 2 and engine.scheduler.max_num_batched_tokens == 32
    assert engine.config.window_stops == engine.scheduler.window_stops == (16, 24)
    assert engine.config.window_budget_ms is None and engine.scheduler.window_budget_s is None  # (default: 300 ms)
    assert not engine.block_manager.enable_prefix_caching
    wavs = chat.infer(list(TEXTS), skip_refine_text=True, split_text=False,
                      params_infer_code=Chat.InferCodeParams(manual_seed=0, max_new_token=20, show_tqdm=False))
    assert len(wavs) == 3 and all(w.size > 0 for w in wavs)
    with pytest.raises(ValueError, match="block_size"):
        Chat().load(source="custom", custom_path=upstream_ckpt, device="cpu", block_size=0)
    with pytest.raises(ValueError, match="use_velocity"):
        chat.infer("hello", use_velocity="yes")


def test_joined_stream_is_the_texts_in_order_with_faded_joins(chat):
    """A server's long input: sentences generated several at once, streamed in order as one signal; the joins
    are faded out and in over FADE samples, nothing is dropped or inserted."""
    from chattts_velocity.audio.joins import FADE

    texts = ["first sentence here", "second one", "and a third", "fourth to finish"]
    p = Chat.InferCodeParams(manual_seed=4, max_new_token=40, min_new_token=20, show_tqdm=False)
    path = chat.pipeline
    joined = np.concatenate(list(path.stream_joined(texts, p, in_flight=2)))
    alone = [np.concatenate(list(path.stream_joined([t], p))) for t in texts]
    assert joined.size == sum(a.size for a in alone)
    ramp = np.linspace(0.0, 1.0, FADE, dtype=np.float32)
    expected = []
    for i, a in enumerate(alone):
        a = a.copy()
        if i:
            a[:FADE] *= ramp
        if i < len(alone) - 1:
            a[-FADE:] *= ramp[::-1]
        expected.append(a)
    assert np.allclose(joined, np.concatenate(expected), atol=1e-4)
    assert engine_is_idle(chat)


def read_without_blocking(audio, woken) -> tuple[np.ndarray, int]:
    """Read a joined stream whose ``on_ready`` sets ``woken``, waiting for it after each ``PENDING``: all its
    samples, and how many ``PENDING`` came."""
    import time

    from chattts_velocity.audio.pump import PENDING

    chunks, pending = [], 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        woken.clear()
        try:
            chunk = next(audio)
        except StopIteration:
            return np.concatenate(chunks), pending
        if chunk is PENDING:
            pending += 1
            assert woken.wait(30), "no notify after PENDING"
        else:
            chunks.append(chunk)
    pytest.fail("the non-blocking stream did not end")


def test_joined_stream_read_without_blocking_gives_the_same_audio(chat):
    """``on_ready``: ``next`` never waits (PENDING when nothing is there), the callback comes from the engine's
    side whenever a chunk may be there, and the chunks add up to the blocking iteration's samples, a
    join between sentences (opened with outputs already waiting) included."""
    import threading


    texts = ["first sentence here", "second one", "and a third"]
    p = Chat.InferCodeParams(manual_seed=7, max_new_token=40, min_new_token=20, show_tqdm=False)
    path = chat.pipeline
    blocking = np.concatenate(list(path.stream_joined(texts, p, in_flight=2)))

    audio = path.stream_joined(texts, p, in_flight=2)
    woken = threading.Event()
    calls = []

    def notify():
        calls.append(threading.current_thread().name)
        woken.set()

    audio.on_ready(notify)
    got, pending = read_without_blocking(audio, woken)
    # the same tokens; windows batched with different neighbours in a decode round differ in the last bits
    assert got.size == blocking.size and np.allclose(got, blocking, rtol=0, atol=1e-5)
    assert pending > 0 and len(calls) >= pending
    # no round ran on the reader's thread (a feed opened with outputs waiting has them taken on a thread of its
    # own, or by the engine's next round, whichever comes first)
    assert "MainThread" not in calls
    assert engine_is_idle(chat)


def test_joined_stream_started_early_runs_before_its_first_next_with_the_same_audio(chat):
    """``start`` (what a server's handler calls before the headers go out): the first texts are submitted and
    their feed is open before any ``next``, so the engine works and the callback comes meanwhile; the audio
    read afterwards is the same. A started stream cancelled before its first ``next`` aborts its requests."""
    import threading
    import time


    texts = ["first sentence here", "second one", "and a third"]
    p = Chat.InferCodeParams(manual_seed=7, max_new_token=40, min_new_token=20, show_tqdm=False)
    path = chat.pipeline
    blocking = np.concatenate(list(path.stream_joined(texts, p, in_flight=2)))

    submitted = chat.engine.stats().num_requests
    audio = path.stream_joined(texts, p, in_flight=2)
    woken = threading.Event()
    audio.on_ready(woken.set)
    audio.start()
    feed = audio._first_feed
    audio.start()  # a second time: no second feed on the same stream
    assert feed is not None and audio._first_feed is feed
    assert chat.engine.stats().num_requests == submitted + 2, "the first two texts are submitted at start"
    assert woken.wait(60), "the engine's news comes before the first next"
    got, _ = read_without_blocking(audio, woken)
    assert got.size == blocking.size and np.allclose(got, blocking, rtol=0, atol=1e-5)
    assert engine_is_idle(chat)

    long = Chat.InferCodeParams(manual_seed=4, max_new_token=300, min_new_token=300, show_tqdm=False)
    audio = path.stream_joined(["long one", "long two"], long, in_flight=2)
    audio.on_ready(lambda: None)
    audio.start()
    time.sleep(0.2)
    audio.cancel()
    assert engine_is_idle(chat)


def test_joined_stream_cancel_from_another_thread_aborts_its_requests(chat):
    import threading

    p = Chat.InferCodeParams(manual_seed=4, max_new_token=300, min_new_token=300, show_tqdm=False)
    audio = chat.pipeline.stream_joined(["long one", "long two", "long three"], p, in_flight=3)
    first = next(audio)
    worker = threading.Thread(target=lambda: [None for _ in audio])  # a thread inside the iterator
    worker.start()
    audio.cancel()
    worker.join(30)
    assert not worker.is_alive() and first.size > 0
    assert engine_is_idle(chat)


def test_velocity_path_warns_when_a_text_hits_its_length_limit(chat, caplog):
    p = Chat.InferCodeParams(manual_seed=0, max_new_token=6, min_new_token=6, show_tqdm=False)
    with caplog.at_level("WARNING", logger="chattts_velocity.pipeline"):
        chat.infer(["cut me short"], skip_refine_text=True, split_text=False, params_infer_code=p)
    assert any("hit its length limit after 6 tokens" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="chattts_velocity.pipeline"):
        list(chat.infer(["cut me short"], stream=True, skip_refine_text=True, split_text=False, params_infer_code=p))
    assert any("length limit" in r.message for r in caplog.records)


def test_freeze_long_lived_keeps_old_objects_out_of_collections_until_thawed():
    """``gc_freeze``: what lives when it is called moves to the permanent generation, which collections skip
    (``Chat.load`` on CUDA and the server's warm-up call it); ``thaw`` gives it back to the collector."""
    import gc
    import weakref

    from chattts_velocity.gc_freeze import freeze_long_lived, thaw

    class Node:
        pass

    old = Node()
    old.self = old  # a cycle: only the collector can free it
    ref = weakref.ref(old)
    try:
        freeze_long_lived()
        assert gc.get_freeze_count() > 0
        del old
        gc.collect()
        assert ref() is not None  # frozen: not scanned, not freed
        young = Node()
        young.self = young
        young_ref = weakref.ref(young)
        del young
        gc.collect()
        assert young_ref() is None  # created after the freeze: collected as usual
        thaw()
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
