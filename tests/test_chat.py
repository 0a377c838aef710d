"""Chat behaviour beyond parity: interrupt, no shared-state mutation, speakers."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from chattts_velocity import Chat

both_paths = pytest.mark.parametrize("use_velocity", [True, False], ids=["velocity", "reference"])


@both_paths
def test_interrupt_stops_a_stream_early(chat, use_velocity):
    kw = dict(manual_seed=1, max_new_token=200, min_new_token=200, stream_batch=4, pass_first_n_batches=0,
              stream_speed=512, show_tqdm=False)
    full = list(chat.infer(["hello world"], stream=True, skip_refine_text=True, split_text=False,
                           params_infer_code=Chat.InferCodeParams(**kw), use_velocity=use_velocity))
    chunks = []
    for chunk in chat.infer(["hello world"], stream=True, skip_refine_text=True, split_text=False,
                            params_infer_code=Chat.InferCodeParams(**kw), use_velocity=use_velocity):
        chunks.append(chunk)
        chat.interrupt()
    total_full = sum(c.shape[1] for c in full)
    total_cut = sum(c.shape[1] for c in chunks)
    assert total_full > 200 * 512 * 0.9
    assert 0 < total_cut < total_full / 4


@both_paths
def test_interrupt_from_another_thread_returns_partial_audio(chat, use_velocity):
    params = Chat.InferCodeParams(manual_seed=1, max_new_token=400, min_new_token=400, show_tqdm=False)
    timer = threading.Timer(0.2, chat.interrupt)
    timer.start()
    wavs = chat.infer(["hello world"], skip_refine_text=True, split_text=False, params_infer_code=params,
                      use_velocity=use_velocity)
    timer.join()
    assert 0 < wavs[0].size < 400 * 512


def test_infer_leaves_default_params_untouched(chat):
    before = vars(Chat.InferCodeParams()).copy()
    chat.infer("Hello world. Second sentence here.", params_refine_text=Chat.RefineTextParams(max_new_token=8,
               manual_seed=0, show_tqdm=False), params_infer_code=None)
    assert vars(Chat.InferCodeParams()) == before


def test_random_speakers_differ_and_are_used(chat):
    a, b = chat.sample_random_speaker(), chat.sample_random_speaker()
    assert a != b
    kw = dict(manual_seed=3, max_new_token=12, show_tqdm=False)
    wa = chat.infer(["hello"], skip_refine_text=True, split_text=False,
                    params_infer_code=Chat.InferCodeParams(spk_emb=a, **kw))[0]
    wb = chat.infer(["hello"], skip_refine_text=True, split_text=False,
                    params_infer_code=Chat.InferCodeParams(spk_emb=b, **kw))[0]
    assert wa.shape != wb.shape or not np.allclose(wa, wb)


def test_same_seed_same_audio(chat):
    kw = dict(manual_seed=3, max_new_token=12, show_tqdm=False)
    runs = [chat.infer(["hello"], skip_refine_text=True, split_text=False,
                       params_infer_code=Chat.InferCodeParams(**kw))[0] for _ in range(2)]
    assert np.array_equal(runs[0], runs[1])
