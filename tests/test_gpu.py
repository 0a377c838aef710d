"""GPU checks (run on the device machine: python -m pytest -m gpu tests/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
TEXTS = ["hello world, the text is short", "你好，是的。speech"]


@pytest.fixture(scope="module")
def cuda_pair(upstream_ckpt):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from upstream_checkpoint import load_upstream

    from chattts_velocity import Chat

    ours = Chat()
    ours.load(source="custom", custom_path=upstream_ckpt, device="cuda")
    up = load_upstream(upstream_ckpt, device="cuda")
    return ours, up


def test_reference_path_matches_upstream_on_cuda(cuda_pair):
    ours, up = cuda_pair
    kw = dict(manual_seed=5, max_new_token=60, show_tqdm=False)
    out = list(ours.reference.infer_code(list(TEXTS), False, ours.InferCodeParams(**kw)))[-1]
    ref = next(up._infer_code(list(TEXTS), False, torch.device("cuda"), True, up.InferCodeParams(**kw)))
    for a, b in zip(out.ids, ref.ids, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    ours_w = ours.infer(list(TEXTS), use_velocity=False, skip_refine_text=True, split_text=False,
                        params_infer_code=ours.InferCodeParams(**kw))
    up_w = up.infer(list(TEXTS), skip_refine_text=True, split_text=False, params_infer_code=up.InferCodeParams(**kw))
    for a, b in zip(ours_w, up_w, strict=True):
        assert a.shape == b.shape and np.isfinite(a).all()
        assert float(np.abs(a - b).max()) < 1e-4


@pytest.mark.parametrize("pump_thread", [False, True], ids=["engine-thread", "pump-thread"])
def test_concurrent_streams_on_cuda_equal_their_solo_runs(cuda_pair, pump_thread, monkeypatch):
    """Threads streaming through the shared CUDA engine (graphs, pipelined windows, batched window decode)
    get as much audio as the same call made offline, of the same loudness; with the audio rounds on the engine's
    thread or on the pump's own (``AudioPump.thread``, decoding while the engine allocates and steps). (Samples
    are not compared one by one: TF32 moves a few near the silence threshold, which both paths drop, and the
    rest shift.)"""
    import threading

    ours, _ = cuda_pair
    monkeypatch.setattr(ours.pipeline.pump, "thread", pump_thread)

    def call(i, stream):
        p = ours.InferCodeParams(manual_seed=i, max_new_token=80, min_new_token=80, show_tqdm=False)
        out = ours.infer([TEXTS[i % 2]], stream=stream, skip_refine_text=True, split_text=False, params_infer_code=p)
        return np.concatenate(list(out), axis=1)[0] if stream else out[0]

    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, call(i, True))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert ours.engine.stats().engine.max_batch_size > 1
    for i in range(8):
        offline = call(i, False)
        assert abs(results[i].size - offline.size) <= 64, (i, results[i].size, offline.size)
        rms = [float(np.sqrt(np.mean(np.square(w, dtype=np.float64)))) for w in (results[i], offline)]
        assert abs(rms[0] - rms[1]) <= 1e-2 * rms[1], f"stream {i}: rms {rms}"
    assert ours.engine.wait_idle(30) and ours.engine.stats().engine.kv_blocks_used == 0


def test_window_decode_graphs_equal_the_eager_decode(cuda_pair):
    """Batches of stream windows decoded by CUDA graph replay (padded with zero windows to a bucket) equal the
    eager decode of the same padded batch, with the decoder's TF32 on and off. (Not the unpadded batch: the
    batch size picks other cuDNN kernels, and torch's default runs convolutions in TF32 even with the
    decoder's TF32 off: 37 windows against 64 differed by 2% of the peak on the tiny random checkpoint.)
    A short length (below the longest window) replays in the few-window buckets, a batch between buckets in
    the ones ``cover`` picks (130 windows of 48 tokens: 128 + 2; 11 of a short length: 8 + 4); a length past
    the longest still decodes eagerly."""
    ours, _ = cuda_pair
    audio = ours.audio
    hidden = 2 * audio.decoder.config.decoder.idim
    gen = torch.Generator(device="cuda").manual_seed(0)
    saved = audio.graphs
    try:
        audio.use_graphs((16, 48))
        assert audio.graphs is not None
        for tf32 in (True, False):
            for batch, length in ((1, 16), (3, 48), (37, 16), (130, 48), (5, 20), (11, 7), (2, 50)):
                windows = list(torch.randn(batch, length, hidden, device="cuda", generator=gen))
                graphed = audio.to_wavs(windows, True, tf32)
                graphs, audio.graphs = audio.graphs, None
                padded, start = [], 0  # each bucket's windows, padded to the bucket, decoded eagerly
                for bucket in graphs.plan(batch, length) or (batch,):
                    part = windows[start : start + bucket]
                    padded.append(audio.to_wavs(part + [torch.zeros_like(part[0])] * (bucket - len(part)), True,
                                                tf32)[: len(part)])
                    start += len(part)
                padded = np.concatenate(padded)
                eager = audio.to_wavs(windows, True, tf32)
                audio.graphs = graphs
                scale = float(np.abs(eager).max())
                assert graphed.shape == eager.shape == (batch, (2 * length - 1) * 256)
                assert np.abs(graphed - padded).max() <= 1e-5 * scale, (tf32, batch, length)
                if graphs.plan(batch, length) in ((batch,), ()):  # no padding: the eager call itself
                    assert np.abs(graphed - eager).max() <= 1e-5 * scale, (tf32, batch, length)
        assert {(t, b) for t, b, _ in audio.graphs._graphs} == {(16, 1), (48, 4), (16, 64), (48, 128), (48, 2),
                                                                  (20, 8), (7, 8), (7, 4)}
        # captured apart from the engine's graphs (torch's default capture stream): two graphs captured on one
        # stream share cuBLAS's workspace, and replayed at once on two streams they hung the device
        default = torch.cuda.graph.default_capture_stream  # set by the engine's captures at load
        assert default is not None and audio.graphs.capture_stream != default
        assert len(audio.graphs._graphs) == 16  # each in TF32 and in float32
    finally:
        audio.graphs = saved
