"""Parity of chattts_velocity.audio (DVAE, Decoder, Vocos, AudioDecoder) with upstream ChatTTS on a tiny random
checkpoint written by upstream's own classes; plus size inference and the errors for malformed input."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from upstream_checkpoint import DVAE_DIM, HIDDEN, VQ_DIM

from chattts_velocity.audio import (
    DVAE,
    AudioDecoder,
    ConvStackConfig,
    DVAEConfig,
    load_vocos,
    vocos_state_dict_config,
)

TOL = 1e-5
LENGTHS = (5, 11, 3)


@pytest.fixture(scope="module")
def asset(upstream_ckpt) -> str:
    """The tiny upstream checkpoint of conftest (written once per session); ``upstream_chat`` is loaded on it."""
    return os.path.join(upstream_ckpt, "asset")


@pytest.fixture(scope="module")
def ours(asset) -> AudioDecoder:
    return AudioDecoder(
        DVAE.from_file(os.path.join(asset, "DVAE.safetensors"), "cpu"),
        DVAE.from_file(os.path.join(asset, "Decoder.safetensors"), "cpu"),
        load_vocos(os.path.join(asset, "Vocos.safetensors"), "cpu"),
        "cpu",
    )


def _max_diff(name: str, got, want) -> float:
    diff = float(np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64)).max())
    print(f"{name}: max abs diff vs upstream {diff:.3g}")
    return diff


def test_config_inference_matches_written_sizes(asset):
    dvae = DVAEConfig.from_state_dict(load_file(os.path.join(asset, "DVAE.safetensors")), "DVAE.safetensors")
    assert dvae == DVAEConfig(
        decoder=ConvStackConfig(DVAE_DIM, DVAE_DIM, 24, 2, 8), dim=DVAE_DIM,
        encoder=ConvStackConfig(DVAE_DIM, VQ_DIM, 24, 2, 8), vq_dim=VQ_DIM, levels=(5, 5, 5, 5), groups=2,
    )
    decoder = DVAEConfig.from_state_dict(load_file(os.path.join(asset, "Decoder.safetensors")), "Decoder")
    assert decoder == DVAEConfig(decoder=ConvStackConfig(HIDDEN // 2, HIDDEN // 2, 24, 2, 8), dim=HIDDEN // 2)
    vocos = vocos_state_dict_config(load_file(os.path.join(asset, "Vocos.safetensors")))
    assert vocos == dict(input_channels=100, dim=32, intermediate_dim=64, num_layers=2, n_fft=1024, hop_length=256)


def test_state_dicts_equal_upstream(upstream_chat, ours):
    for part in ("dvae", "decoder", "vocos"):
        mine, theirs = getattr(ours, part), getattr(upstream_chat, part)
        want = theirs.state_dict()
        got = mine.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_dvae_decode_codes(upstream_chat, ours):
    codes = torch.randint(0, 625, (2, 4, 7), generator=torch.Generator().manual_seed(1))
    got = ours.dvae.decode(codes)
    want = upstream_chat.dvae(codes.clone(), "decode")
    assert got.shape == (2, 100, 14)
    assert _max_diff("DVAE decode", got, want) <= TOL


def test_decoder_decode_hiddens(upstream_chat, ours):
    hiddens = torch.randn(2, HIDDEN, 9, generator=torch.Generator().manual_seed(2))
    kept = hiddens.clone()
    got = ours.decoder.decode(hiddens)
    want = upstream_chat.decoder(hiddens.clone(), "decode")
    assert torch.equal(hiddens, kept)
    assert got.shape == (2, 100, 18)
    assert _max_diff("Decoder decode", got, want) <= TOL


def test_encode_matches_upstream(upstream_chat, ours):
    wav = 0.5 * torch.randn(12000, generator=torch.Generator().manual_seed(3))  # 0.5 s at 24 kHz
    got = ours.sample_audio(wav.numpy())
    want = upstream_chat.dvae.sample_audio(wav.clone())
    assert got.shape == (4, (12000 // 256 + 1) // 2)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_quantizer_matches_upstream(upstream_chat, ours, scale):
    """FSQ on features spread over every level (the tiny encoder saturates, so wavs alone reach few codes)."""
    feats = scale * torch.randn(2, VQ_DIM, 50, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        codes = ours.dvae.vq_layer.encode(feats)
        want = upstream_chat.dvae.vq_layer(feats.clone())  # upstream transposes its input in place
        got = ours.dvae.vq_layer.decode(codes)
        want_feats = upstream_chat.dvae.vq_layer._embed(want.clone())
    assert len(codes.unique()) > 50
    assert codes.dtype == want.dtype and torch.equal(codes, want)
    assert _max_diff("FSQ decode", got, want_feats) <= TOL


@pytest.mark.parametrize("use_decoder", [False, True])
def test_to_wavs_matches_upstream(upstream_chat, ours, use_decoder):
    gen = torch.Generator().manual_seed(4)
    if use_decoder:
        results = [torch.randn(n, HIDDEN, generator=gen) for n in LENGTHS]
    else:
        results = [torch.randint(0, 625, (n, 4), generator=gen) for n in LENGTHS]
    got = ours.to_wavs(results, use_decoder)
    want = upstream_chat._decode_to_wavs(list(results), use_decoder)  # upstream empties the list it is given
    assert len(results) == len(LENGTHS)
    assert got.dtype == np.float32
    assert got.shape == want.shape == (3, (2 * max(LENGTHS) - 1) * 256)  # centred iSTFT of 2 mel frames per step
    assert _max_diff(f"to_wavs(use_decoder={use_decoder})", got, want) <= TOL


@pytest.mark.parametrize("use_decoder", [False, True])
def test_to_wav_list_decodes_rows_of_different_lengths_as_each_alone(ours, use_decoder, monkeypatch):
    """One batch of rows of different lengths (every convolution and the iSTFT read a row's padding as zeros)
    gives each row's own decode; padding alone (``to_wavs``) would change the shorter rows' ends."""
    from chattts_velocity.audio import decode

    gen = torch.Generator().manual_seed(5)
    lengths = (5, 17, 1, 9, 0, 17, 30)
    if use_decoder:
        results = [torch.randn(n, HIDDEN, generator=gen) for n in lengths]
    else:
        results = [torch.randint(0, 625, (n, 4), generator=gen) for n in lengths]
    alone = [ours.to_wavs([r], use_decoder)[0] if r.shape[0] else np.zeros(0, np.float32) for r in results]
    assert not ours.mixed_lengths  # the CPU's default: one length a batch
    monkeypatch.setattr(ours, "mixed_lengths", True)
    batches = []
    decode_rows = decode.AudioDecoder._decode_rows
    monkeypatch.setattr(decode.AudioDecoder, "_decode_rows",
                        lambda self, results, idx, *a: batches.append(len(idx)) or decode_rows(self, results, idx, *a))
    for budget, sizes in ((decode.DECODE_TOKENS, [6]), (40, [3, 2, 1])):  # sorted runs of at most 40 steps
        monkeypatch.setattr(decode, "DECODE_TOKENS", budget)
        batches.clear()
        got = ours.to_wav_list(results, use_decoder)
        assert batches == sizes
        for n, g, a in zip(lengths, got, alone, strict=True):
            assert g.dtype == np.float32 and g.shape == a.shape == ((2 * n - 1) * 256 if n else 0,)
            assert n == 0 or _max_diff(f"to_wav_list row of {n}", g, a) <= TOL
    padded = ours.to_wavs(results[:2], use_decoder)[0][: alone[0].size]
    assert _max_diff("padded row of 5", padded, alone[0]) > 100 * TOL
    monkeypatch.setattr(ours, "mixed_lengths", False)
    batches.clear()
    got = ours.to_wav_list(results, use_decoder)
    assert batches == [1, 1, 1, 2, 1]  # lengths 1, 5, 9, 17 (twice), 30
    for n, g, a in zip(lengths, got, alone, strict=True):
        assert g.shape == a.shape and (n == 0 or _max_diff(f"one length a batch, row of {n}", g, a) <= TOL)


def test_to_wavs_empty(ours):
    wavs = ours.to_wavs([], use_decoder=False)
    assert wavs.dtype == np.float32 and wavs.size == 0


def test_tf32_applies_only_on_cuda_and_is_restored_even_on_error(ours):
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    with ours._precision(True):  # a CPU decoder: nothing to change
        assert (matmul.fp32_precision, conv.fp32_precision) == before
    cuda = AudioDecoder(ours.dvae, ours.decoder, ours.vocos, "cpu")
    cuda.device = torch.device("cuda")  # the flags are process-wide and settable without a GPU
    with pytest.raises(RuntimeError, match="mid-decode"):
        with cuda._precision(True):
            assert matmul.fp32_precision == conv.fp32_precision == "tf32"
            raise RuntimeError("mid-decode")
    assert (matmul.fp32_precision, conv.fp32_precision) == before
    with cuda._precision(False):  # the reference path's call
        assert (matmul.fp32_precision, conv.fp32_precision) == before


def _mangled(asset: str, tmp_path, file: str, edit) -> str:
    sd = load_file(os.path.join(asset, file))
    edit(sd)
    path = str(tmp_path / file)
    save_file(sd, path)
    return path


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("DVAE.safetensors", lambda sd: sd.update({"decoder.decoder_block.1.pwconv2.weight": torch.zeros(24, 95)}),
         r"DVAE.safetensors: decoder.decoder_block.1.pwconv2.weight has shape \(24, 95\), expected \(24, 96\)"),
        ("DVAE.safetensors", lambda sd: sd.pop("vq_layer.quantizer.rvqs.1.project_out.bias"),
         "DVAE.safetensors: missing key vq_layer.quantizer.rvqs.1.project_out.bias"),
        ("DVAE.safetensors", lambda sd: sd.update({"out_conv.weight": torch.zeros(100, 12, 3)}),
         "DVAE.safetensors: inconsistent DVAE sizes: decoder.odim 16 != dim 12"),
        ("Decoder.safetensors", lambda sd: sd.update({"extra.weight": torch.zeros(1)}),
         "Decoder.safetensors: unexpected key extra.weight"),
        ("Decoder.safetensors", lambda sd: sd.pop("decoder.decoder_block.0.dwconv.weight"),
         "Decoder.safetensors: missing key decoder.decoder_block.0.dwconv.weight"),
    ],
)
def test_malformed_dvae_checkpoint(asset, tmp_path, file, edit, message):
    with pytest.raises(ValueError, match=message):
        DVAE.from_file(_mangled(asset, tmp_path, file, edit), "cpu")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda sd: sd.update({"backbone.convnext.1.gamma": torch.zeros(31)}),
         r"Vocos.safetensors: backbone.convnext.1.gamma has shape \(31,\), expected \(32,\)"),
        (lambda sd: sd.update({"head.out.weight": torch.zeros(1025, 32)}),
         "Vocos.safetensors: head.out.weight has 1025 outputs"),
        (lambda sd: sd.pop("backbone.embed.weight"), "Vocos.safetensors: missing key backbone.embed.weight"),
    ],
)
def test_malformed_vocos_checkpoint(asset, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_vocos(_mangled(asset, tmp_path, "Vocos.safetensors", edit), "cpu")


def test_missing_file(tmp_path):
    path = str(tmp_path / "nowhere" / "DVAE.safetensors")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        DVAE.from_file(path, "cpu")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_vocos(path, "cpu")


@pytest.mark.parametrize(
    "wav",
    [
        np.zeros((2, 4000), dtype=np.float32),
        np.zeros(4000, dtype=np.int16),
        np.zeros(0, dtype=np.float32),
        np.zeros(300, dtype=np.float32),
        np.array([0.0, np.nan] * 2000, dtype=np.float32),
        torch.full((4000,), float("inf")),
        [0.0] * 4000,
    ],
)
def test_sample_audio_rejects_bad_wav(ours, wav):
    with pytest.raises(ValueError, match="wav"):
        ours.sample_audio(wav)


def test_decoder_cannot_encode(ours):
    with pytest.raises(ValueError, match="cannot encode"):
        ours.decoder.encode(torch.zeros(4000))


@pytest.mark.parametrize(
    ("model", "x", "message"),
    [
        ("dvae", torch.zeros(1, 3, 5, dtype=torch.long), r"codes must be an int tensor \[B, 4, T\]"),
        ("dvae", torch.zeros(1, 4, 5), "codes must be an int tensor"),
        ("dvae", torch.full((1, 4, 5), 625), r"codes must lie in \[0, 625\)"),
        ("decoder", torch.zeros(1, HIDDEN + 1, 5), rf"hidden states must be a float tensor \[B, {HIDDEN}, T\]"),
    ],
)
def test_decode_rejects_bad_input(ours, model, x, message):
    with pytest.raises(ValueError, match=message):
        getattr(ours, model).decode(x)


def _stack(idim: int, odim: int, hidden: int) -> dict:
    return dict(idim=idim, odim=odim, hidden=hidden, n_layer=12, bn_dim=128)


def test_full_size_configs_round_trip():
    """Upstream's released-model sizes survive inference from an upstream-built state dict. (Literal sizes:
    the fixture edits the defaults of ChatTTS.config in place.)"""
    from ChatTTS.model.dvae import DVAE as UpstreamDVAE
    from vocos import Vocos
    from vocos.feature_extractors import MelSpectrogramFeatures
    from vocos.heads import ISTFTHead
    from vocos.models import VocosBackbone

    dvae = UpstreamDVAE(
        decoder_config=_stack(512, 512, 256), encoder_config=_stack(512, 1024, 256),
        vq_config=dict(dim=1024, levels=(5, 5, 5, 5), G=2, R=2), dim=512,
    )
    assert DVAEConfig.from_state_dict(dvae.state_dict(), "DVAE") == DVAEConfig(
        decoder=ConvStackConfig(512, 512, 256, 12, 128), dim=512,
        encoder=ConvStackConfig(512, 1024, 256, 12, 128), vq_dim=1024,
    )
    decoder = UpstreamDVAE(decoder_config=_stack(384, 384, 512), dim=384)
    assert DVAEConfig.from_state_dict(decoder.state_dict(), "Decoder") == DVAEConfig(
        decoder=ConvStackConfig(384, 384, 512, 12, 128), dim=384,
    )
    vocos = Vocos(
        feature_extractor=MelSpectrogramFeatures(padding="center"),
        backbone=VocosBackbone(input_channels=100, dim=512, intermediate_dim=1536, num_layers=8),
        head=ISTFTHead(dim=512, n_fft=1024, hop_length=256, padding="center"),
    )
    assert vocos_state_dict_config(vocos.state_dict()) == dict(
        input_channels=100, dim=512, intermediate_dim=1536, num_layers=8, n_fft=1024, hop_length=256
    )


@pytest.mark.parametrize("frames", [2, 7, 96])
def test_istft_center_equals_torch_istft(frames):
    """The graph-safe iSTFT (no host-side check) computes what Vocos's torch.istft(center=True) does."""
    from chattts_velocity.audio.vocoder import istft_center, window_envelope

    n_fft, hop = 1024, 256
    gen = torch.Generator().manual_seed(frames)
    spec = torch.complex(torch.randn(3, n_fft // 2 + 1, frames, generator=gen),
                         torch.randn(3, n_fft // 2 + 1, frames, generator=gen))
    window = torch.hann_window(n_fft)
    ref = torch.istft(spec, n_fft, hop, n_fft, window, center=True)
    for envelope in (None, window_envelope(window, frames, hop)):
        got = istft_center(spec, n_fft, hop, window, envelope)
        assert got.shape == ref.shape == (3, hop * (frames - 1))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # rows of their own lengths: each as torch.istft of its first frames alone
    own = torch.tensor([frames, max(frames // 2, 2), 2], dtype=torch.int32)
    got = istft_center(spec, n_fft, hop, window, frames=own)
    assert got.shape == ref.shape
    for row, n in enumerate(own.tolist()):
        alone = torch.istft(spec[row, :, :n], n_fft, hop, n_fft, window, center=True)
        torch.testing.assert_close(got[row, : hop * (n - 1)], alone, rtol=1e-5, atol=1e-5)


def test_graph_decode_function_equals_the_eager_decode(ours):
    """``decode_wav`` (what the CUDA graphs capture) equals Decoder + Vocos.decode on the tiny checkpoint."""
    from chattts_velocity.audio.graphs import decode_wav

    x = torch.randn(3, 2 * ours.decoder.config.decoder.idim, 16, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = ours.vocos.decode(ours.decoder.decode(x))
        got = decode_wav(ours.decoder, ours.vocos, x)
    assert got.shape == ref.shape == (3, 31 * 256)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_vocos_decode_is_the_package_decode_bit_for_bit(ours):
    """``vocos_decode`` (the eager decode's vocoder, its head's spectrum built by ``head_spectrum``) gives exactly
    ``Vocos.decode``'s samples, also at magnitudes the head clips, and the spectrum is the head's own."""
    from chattts_velocity.audio.vocoder import head_spectrum, vocos_decode

    gen = torch.Generator().manual_seed(3)
    mel = torch.randn(4, 100, 40, generator=gen)
    with torch.inference_mode():
        features = ours.vocos.backbone(mel)
        head = ours.vocos.head
        mag, phase = head.out(features).transpose(1, 2).chunk(2, dim=1)
        want_spec = torch.exp(mag).clip(max=1e2) * (torch.cos(phase) + 1j * torch.sin(phase))
        assert torch.equal(head_spectrum(head, features), want_spec)
        assert torch.equal(vocos_decode(ours.vocos, mel), ours.vocos.decode(mel))
        loud = features * 50  # magnitudes past the clip
        spec = head_spectrum(head, loud)
        assert (spec.abs() > 99).any() and spec.abs().max() <= 1e2 * (1 + 1e-6)
        assert torch.equal(head.istft(spec), head(loud))


def test_use_graphs_is_a_no_op_off_cuda(ours):
    ours.use_graphs((16, 48), capture=True)
    assert ours.graphs is None


def test_cover_is_the_cheapest_split_of_a_batch_over_the_buckets():
    """``cover`` against every multiset of buckets (up to 4 replays, or 5 of the few-window buckets): its
    buckets hold the batch, cost no more than any other that does, and among those cost the fewest replays."""
    import itertools

    from chattts_velocity.audio.graphs import BATCH_BUCKETS, SHORT_BUCKETS, cover

    for buckets, most in ((BATCH_BUCKETS, 4), (SHORT_BUCKETS, 5)):
        for replay in (0, 3, 8, 40):
            for batch in range(1, 2 * max(buckets) + 1):
                parts = cover(batch, buckets, replay)
                assert sum(parts) >= batch and list(parts) == sorted(parts, reverse=True)
                cost = sum(parts) + replay * len(parts)
                for n in range(1, most + 1):
                    for other in itertools.combinations_with_replacement(buckets, n):
                        if sum(other) >= batch:
                            other_cost = sum(other) + replay * n
                            assert cost <= other_cost, (batch, replay, parts, other)
                            if cost == other_cost:
                                assert len(parts) <= n, (batch, replay, parts, other)
    assert cover(130, BATCH_BUCKETS, 8) == (128, 2) and cover(9, SHORT_BUCKETS, 8) == (8, 1)
    with pytest.raises(ValueError, match="batch >= 1"):
        cover(0, BATCH_BUCKETS, 8)


def test_decode_graphs_take_only_their_lengths_and_buckets(ours):
    """The window lengths replay in every batch bucket, the other lengths below the longest (a short stream's
    last windows) in the few-window buckets, a batch between buckets in the ones ``cover`` picks (a larger one
    in its largest as often as it fills it); a longer window has no graph (``run`` returns None and
    ``to_wavs`` decodes it eagerly)."""
    from chattts_velocity.audio.graphs import BATCH_BUCKETS, SHORT_BUCKETS, DecodeGraphs

    graphs = DecodeGraphs(ours.decoder, ours.vocos, torch.device("cpu"), (16, 48))
    hidden = 2 * ours.decoder.config.decoder.idim
    assert graphs.run(torch.zeros(2, hidden, 49), True) is None
    assert graphs.short_lengths == frozenset(range(1, 48)) - {16}
    assert [graphs.plan(b, 48) for b in (1, 3, 37, 130, 256, 300)] == [(1,), (4,), (32, 8), (128, 2), (256,),
                                                                        (256, 32, 16)]
    assert [graphs.plan(b, 17) for b in (1, 3, 8, 9)] == [(1,), (4,), (8,), (8, 1)] and graphs.plan(1, 49) == ()
    assert graphs.plan(37, 16) == (64,)  # a replay costs more windows of a shorter length
    assert graphs.buckets(16) == BATCH_BUCKETS and graphs.buckets(1) == SHORT_BUCKETS and graphs.buckets(0) == ()


class _GatedDecoder:
    """A stand-in ``AudioDecoder`` for ``SharedDecode``: ``to_wav_list`` records its batch, waits for ``gate``
    on the first call, and returns each sequence's "wav" as its values plus the batch's number."""

    device = torch.device("cpu")

    def __init__(self):
        import contextlib
        import threading

        self.gate, self.entered, self.batches = threading.Event(), threading.Event(), []
        self.stream = contextlib.nullcontext
        self.fail_next = False

    def to_wav_list(self, results, use_decoder):
        self.batches.append((len(results), use_decoder))
        self.entered.set()
        self.gate.wait(10)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("decode failed")
        return [r.numpy() + 1000 * len(self.batches) for r in results]


def _calls_while_one_decodes(shared, fake, calls: list[tuple[list, bool]]) -> list:
    """Start a first call (alone in its decode, held at the gate), then ``calls`` on threads of their own
    waiting for it; release the gate; every call's wavs (or error), the first one's first."""
    import threading

    outcomes = [None] * (len(calls) + 1)

    def run(i, results, use_decoder):
        try:
            outcomes[i] = shared.to_wav_list(results, use_decoder)
        except BaseException as err:  # noqa: BLE001 - a KeyboardInterrupt too: kept for the test to look at
            outcomes[i] = err

    first = threading.Thread(target=run, args=(0, [torch.zeros(1)], True))
    first.start()
    assert fake.entered.wait(10)
    threads = [threading.Thread(target=run, args=(i + 1, *c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(shared._waiting) < len(calls) and time.monotonic() < deadline:  # all queued behind the first
        time.sleep(0.01)
    fake.gate.set()
    for t in [first, *threads]:
        t.join(10)
    return outcomes


def test_shared_decode_takes_the_calls_waiting_into_one_decode_each_getting_its_own():
    from chattts_velocity.audio.decode import SharedDecode

    fake = _GatedDecoder()
    shared = SharedDecode(fake)
    calls = [([torch.full((2,), float(i)), torch.full((3,), float(i) + 0.5)], True) for i in range(1, 5)]
    calls.append(([torch.full((1,), 9.0)], False))  # codes: a decode of their own
    outcomes = _calls_while_one_decodes(shared, fake, calls)
    assert fake.batches[0] == (1, True)
    assert sorted(fake.batches[1:]) == [(1, False), (8, True)]  # four calls' sequences in one decode
    assert shared.decodes == 2
    for (results, _), wavs in zip(calls, outcomes[1:], strict=True):
        assert [w.tolist() for w in wavs] == [(r.numpy() + w[0] - r[0].item()).tolist() for r, w in
                                              zip(results, wavs, strict=True)]
        assert all(w[0] - r[0].item() in (2000, 3000) for r, w in zip(results, wavs, strict=True))
    assert outcomes[0][0].tolist() == [1000.0]


def test_shared_decode_raises_its_error_in_every_call_it_held_and_goes_on():
    from chattts_velocity.audio.decode import SharedDecode

    fake = _GatedDecoder()
    shared = SharedDecode(fake)
    fake.fail_next = True  # the first call's decode fails
    outcomes = _calls_while_one_decodes(shared, fake, [([torch.ones(2)], True), ([torch.ones(3)], True)])
    assert isinstance(outcomes[0], RuntimeError)
    assert [w.shape for w in outcomes[1]] == [(2,)] and [w.shape for w in outcomes[2]] == [(3,)]
    fake.fail_next = True
    with pytest.raises(RuntimeError, match="decode failed"):
        shared.to_wav_list([torch.ones(1)], True)
    assert shared.to_wav_list([torch.ones(1)], True)[0].shape == (1,)  # not left running
    assert not shared._running and not shared._waiting


def test_shared_decode_interrupted_in_its_leader_fails_the_calls_it_held_instead_of_hanging():
    from chattts_velocity.audio.decode import SharedDecode

    fake = _GatedDecoder()
    shared = SharedDecode(fake)
    runs = []

    def decode(calls):
        runs.append(len(calls))
        if len(runs) == 2:  # the decode of the two calls that waited: Ctrl-C in its leader, part way
            raise KeyboardInterrupt
        return SharedDecode._decode(shared, calls)

    shared._decode = decode
    outcomes = _calls_while_one_decodes(shared, fake, [([torch.ones(2)], True), ([torch.ones(3)], True)])
    assert runs == [1, 2]
    assert outcomes[0][0].tolist() == [1000.0]
    kinds = sorted(type(o).__name__ for o in outcomes[1:])
    assert kinds == ["KeyboardInterrupt", "RuntimeError"]  # the leader's own, and the call it held: no hang
    assert "interrupted" in str(next(o for o in outcomes[1:] if isinstance(o, RuntimeError)))
    assert not shared._running and not shared._waiting
    assert shared.to_wav_list([torch.ones(1)], True)[0].shape == (1,)  # and it goes on


def test_shared_decode_gathers_the_expected_calls_that_keep_arriving(monkeypatch):
    """Calls announced with ``expecting`` that arrive within the quiet time of each other share one decode, and
    one that fails is not waited for; one still generating after the quiet time is not waited for beyond it."""
    import threading

    from chattts_velocity.audio.decode import SharedDecode

    fake = _GatedDecoder()
    fake.gate.set()
    shared = SharedDecode(fake)
    monkeypatch.setattr(SharedDecode, "GATHER_MAX_S", 30.0)
    results, announced = {}, None

    def call(name, before=None, fail=False):
        with contextlib.suppress(ValueError), shared.expecting() as expected:
            announced.wait(10)  # every call announced before any arrives, as requests submitted together are
            if before is not None:
                assert before(), name  # generating until then
            if fail:
                raise ValueError("generation failed")
            results[name] = shared.to_wav_list([torch.ones(1)], True, expected)

    def run(*calls):
        nonlocal announced
        announced = threading.Barrier(len(calls))
        threads = [threading.Thread(target=call, args=c) for c in calls]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return time.monotonic() - start

    def first_waiting():  # b, c and d go on once a waits for them
        deadline = time.monotonic() + 10
        while not shared._waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        return bool(shared._waiting)

    monkeypatch.setattr(SharedDecode, "GATHER_QUIET_S", 10.0)
    took = run(("a",), ("b", first_waiting), ("c", first_waiting), ("d", first_waiting, True))
    assert fake.batches == [(3, True)] and shared.decodes == 1  # a waited for b and c, not for the failed d
    assert "d" not in results and all(results[n][0].shape == (1,) for n in "abc")
    assert took < 5  # the last of them ended the wait, not the quiet time

    fake.batches.clear()
    monkeypatch.setattr(SharedDecode, "GATHER_QUIET_S", 0.2)
    took = run(("e",), ("f", lambda: fake.entered.wait(10) and _wait_for(lambda: fake.batches)))
    assert fake.batches == [(1, True), (1, True)]  # f, still generating after the quiet time: a decode of its own
    assert took < 10  # e did not wait for f beyond the quiet time (nor up to GATHER_MAX_S)
    assert not shared._running and not shared._waiting and shared._expected == 0


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return bool(condition())
