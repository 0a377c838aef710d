"""Many threads share one ``Chat``: their ``infer`` calls meet in the engine's batches, each gets exactly what
the same call returns alone, a caller that closes its stream stops only itself, ``interrupt`` stops every
call in flight with what it has, and the KV pool is full again afterwards."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from chattts_velocity import Chat

TEXTS = ["hello world, the text is short", "你好，是的。speech", "a b c", "the quick brown fox", "one more line",
         "streaming is fun", "数字一二三", "good night"]


@pytest.fixture(scope="module")
def fresh_chat(upstream_ckpt):
    """Its own engine, so the batch statistics count only this module's calls."""
    chat = Chat()
    chat.load(source="custom", custom_path=upstream_ckpt, device="cpu")
    yield chat
    chat.unload()


QUITTER = 3
"""A streaming caller that stops after its first chunk."""


def calls(chat) -> list[dict]:
    """16 different calls: texts, seeds, speakers, stream or not, both decoders, two refine-only."""
    speakers = [chat.sample_random_speaker() for _ in range(3)]
    out = []
    for i in range(16):
        code = Chat.InferCodeParams(manual_seed=100 + i, spk_emb=speakers[i % 3] if i % 4 else None,
                                    max_new_token=24 + 4 * (i % 5), show_tqdm=False)
        kw = dict(text=[TEXTS[i % len(TEXTS)]], skip_refine_text=True, split_text=False, params_infer_code=code,
                  use_decoder=i % 3 != 0, stream=i % 2 == 1)
        if i == QUITTER:  # long enough that its first chunk cannot be all of it
            kw["params_infer_code"] = Chat.InferCodeParams(manual_seed=100 + i, max_new_token=200, min_new_token=200,
                                                           show_tqdm=False)
        if i in (4, 10):
            kw.update(skip_refine_text=False, refine_text_only=True, stream=False, params_refine_text=Chat.RefineTextParams(
                manual_seed=i, max_new_token=10, show_tqdm=False))
        out.append(kw)
    return out


def run(chat, kw, close_after: int | None = None):
    result = chat.infer(**kw)
    if not kw["stream"]:
        return result
    chunks = []
    for chunk in result:
        chunks.append(chunk)
        if close_after is not None and len(chunks) >= close_after:
            result.close()
            break
    return np.concatenate(chunks, axis=1)[0]


def same(a, b) -> bool:
    if isinstance(a, list) and a and isinstance(a[0], str):
        return a == b
    a = a[0] if isinstance(a, list) else a
    b = b[0] if isinstance(b, list) else b
    # hidden states carry the batch's float rounding (~1e-6): the decoded audio agrees to 1e-4
    return a.shape == b.shape and np.allclose(a, b, atol=1e-4)


def test_sixteen_threads_get_their_own_results_batched_together(fresh_chat):
    chat = fresh_chat
    kws = calls(chat)
    quitter = QUITTER
    results, errors = {}, []
    barrier = threading.Barrier(len(kws))

    def worker(i):
        try:
            barrier.wait()
            results[i] = run(chat, kws[i], close_after=1 if i == quitter else None)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(kws))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    stats = chat.engine.stats()
    assert stats.engine.max_batch_size >= 4, "the calls did not run batched together"
    assert chat.engine.wait_idle(30) and chat.engine.stats().engine.kv_blocks_used == 0
    for i, kw in enumerate(kws):
        alone = run(chat, kw)
        if i == quitter:
            assert 0 < results[i].size < alone.size
            assert np.allclose(results[i], alone[: results[i].size], atol=1e-4), "the quitter's first chunk"
        else:
            assert same(results[i], alone), f"call {i} differs from the same call made alone"
    assert chat.engine.wait_idle(30) and chat.engine.stats().engine.kv_blocks_used == 0


def test_interrupt_stops_every_call_in_flight_with_what_it_has(fresh_chat):
    chat = fresh_chat
    long = Chat.InferCodeParams(manual_seed=1, max_new_token=400, min_new_token=400, show_tqdm=False)
    results = {}

    def worker(i):
        results[i] = chat.infer([TEXTS[i]], skip_refine_text=True, split_text=False, params_infer_code=long)[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30

    def started() -> int:  # calls of this test whose request has produced tokens
        live = [t for t in chat.engine.stats().requests.values() if t.finished is None]
        return sum(t.first_token is not None for t in live)

    while started() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    chat.interrupt()
    for t in threads:
        t.join(60)
    assert len(results) == 3
    assert all(0 < w.size < 300 * 512 for w in results.values()), [w.size for w in results.values()]
    assert chat.engine.wait_idle(30) and chat.engine.stats().engine.kv_blocks_used == 0
    # later calls are not affected
    short = Chat.InferCodeParams(manual_seed=1, max_new_token=20, min_new_token=20, show_tqdm=False)
    wav = chat.infer(["after"], skip_refine_text=True, split_text=False, params_infer_code=short)[0]
    assert wav.size > 15 * 512


def test_unload_stops_the_engine_thread(upstream_ckpt):
    chat = Chat()
    chat.load(source="custom", custom_path=upstream_ckpt, device="cpu")
    chat.infer(["warm"], skip_refine_text=True, split_text=False,
               params_infer_code=Chat.InferCodeParams(max_new_token=8, show_tqdm=False))
    thread = chat.engine._thread
    assert thread is not None and thread.is_alive()
    chat.unload()
    thread.join(10)
    assert not thread.is_alive() and chat.engine is None
    with pytest.raises(RuntimeError, match="load"):
        chat.infer("hello")


def test_unload_waits_for_a_hung_engine_thread_only_so_long(upstream_ckpt, monkeypatch):
    """An engine thread stuck in a step (a hung device call) does not hang ``unload`` (nor the interpreter's
    exit after it): it waits ``STOP_WAIT_S`` and returns; the thread ends once its step does."""
    import time

    import chattts_velocity.chat as chat_module

    chat = Chat()
    chat.load(source="custom", custom_path=upstream_ckpt, device="cpu")
    engine = chat.engine
    stuck, release = threading.Event(), threading.Event()
    step = engine.engine.step

    def hung_step():
        stuck.set()
        release.wait(60)
        return step()

    monkeypatch.setattr(engine.engine, "step", hung_step)
    monkeypatch.setattr(chat_module, "STOP_WAIT_S", 0.5)
    errors = []

    def call():
        try:
            chat.infer(["stuck"], skip_refine_text=True, split_text=False,
                       params_infer_code=Chat.InferCodeParams(max_new_token=8, show_tqdm=False))
        except RuntimeError as err:
            errors.append(err)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert stuck.wait(30)
        start = time.monotonic()
        chat.unload()
        assert time.monotonic() - start < 10 and chat.engine is None
        assert engine._thread.is_alive()  # still in its step
    finally:
        release.set()
    engine._thread.join(30)
    caller.join(30)
    assert not engine._thread.is_alive() and not caller.is_alive()
    assert len(errors) == 1 and "unloaded" in str(errors[0])  # the call in flight learns why


def test_server_warm_up_runs_every_level_and_leaves_the_engine_idle(fresh_chat):
    """``serve``'s warm-up (on CUDA before it listens) streams each level twice, together and staggered, and
    leaves nothing behind; off CUDA the window-decode graphs stay off."""
    import gc

    from chattts_velocity.serving.load import warm_up

    before = fresh_chat.engine.stats().num_requests
    try:
        warm_up(fresh_chat, streams=(1, 3), tokens=6)
        assert gc.get_freeze_count() > 0  # what the server built stays out of the collector's scans
    finally:
        gc.unfreeze()  # the rest of the test session is no server
    assert fresh_chat.engine.wait_idle(30)
    assert fresh_chat.engine.stats().num_requests - before == 2 * (1 + 3)
    stats = fresh_chat.engine.stats().engine
    assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
    assert fresh_chat.audio.graphs is None
