"""The speech server's encoders (chattts_velocity.server.audio_format): every format, streamed in random
chunks and whole, decoded back with PyAV and checked for rate, channels, length and content (bit-exact for
the lossless ones); early first bytes (flac: the whole file, with its length, at the end); WAV headers;
clipping; and the errors for misuse."""

from __future__ import annotations

import io
import struct
import sys

import numpy as np
import pytest
import soundfile as sf

from chattts_velocity.server.audio_format import (
    CONTENT_TYPES,
    FORMATS,
    WHOLE_FORMATS,
    StreamEncoder,
    encode_all,
)

av = pytest.importorskip("av")

SR = 24000
N = int(1.5 * SR)
SINE = (0.8 * np.sin(2 * np.pi * 440 * np.arange(N) / SR)).astype(np.float32)
LOSSLESS = ("pcm", "wav", "flac")
STREAMED = tuple(fmt for fmt in FORMATS if fmt not in WHOLE_FORMATS)

STREAMED_EXTRA = {
    "pcm": (0, 0),
    "wav": (0, 0),
    "flac": (0, 0),
    # Ogg Opus: the OpusHead pre-skip drops the encoder's priming and the last granule position the padding.
    "opus": (0, 0),
    # ADTS cannot signal priming: 1024 samples of encoder delay, then padding to a whole 1024-sample frame.
    "aac": (1024, 1024 + 1023),
    # No LAME tag when streamed (it is written by seeking back): LAME's 576-sample delay, the padding of the
    # last 576-sample frame and up to two flush frames stay in the decoded audio.
    "mp3": (576, 576 * 4),
}
"""Decoded samples (at 24 kHz) beyond the input allowed per streamed format: (fewest, most)."""

WHOLE_EXTRA = {**STREAMED_EXTRA, "mp3": (0, 0)}
"""encode_all may seek back: the mp3 LAME tag tells the decoder to trim delay and padding exactly."""


def _quantised(x: np.ndarray) -> np.ndarray:
    """The int16 quantisation the encoders promise: clip to [-1, 1], scale by 32767, round."""
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)


def _chunks(x: np.ndarray, seed: int = 0) -> list[np.ndarray]:
    """x cut into random sizes, every third one empty."""
    rng, out, i = np.random.default_rng(seed), [], 0
    while i < x.size:
        size = 0 if len(out) % 3 == 0 else int(rng.integers(1, 2500))
        out.append(x[i : i + size])
        i += size
    return out


def _stream(fmt: str, x: np.ndarray, seed: int = 0) -> bytes:
    enc = StreamEncoder(fmt, SR)
    data = b"".join(enc.encode(chunk) for chunk in _chunks(x, seed))
    assert enc.num_samples == x.size
    return data + enc.finish()


def _decode(fmt: str, data: bytes) -> tuple[np.ndarray, int]:
    """(mono samples as decoded, decoded sample rate); pcm is read as bare s16le."""
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return np.frombuffer(data, "<i2"), SR
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    assert frames, f"{fmt}: nothing decoded"
    assert {f.layout.nb_channels for f in frames} == {1}
    rates = {f.sample_rate for f in frames}
    assert len(rates) == 1
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]), rates.pop()


def _check_decoded(fmt: str, data: bytes, extra: tuple[int, int], x: np.ndarray = SINE) -> None:
    samples, rate = _decode(fmt, data)
    # Ogg Opus always decodes at 48 kHz (RFC 7845); the 24 kHz input rate is recorded in the OpusHead.
    assert rate == (48000 if fmt == "opus" else SR)
    got = samples.size * SR // rate - x.size
    assert extra[0] <= got <= extra[1], f"{fmt}: {got} samples beyond the input, expected {extra}"
    if fmt in LOSSLESS:
        assert samples.dtype == np.int16
        np.testing.assert_array_equal(samples[: x.size], _quantised(x))
    else:
        _check_sine(fmt, samples.astype(np.float64), rate, x)


def _check_sine(fmt: str, y: np.ndarray, rate: int, x: np.ndarray) -> None:
    """A lossy decode still holds the input's 440 Hz tone at its loudness."""
    peak_hz = np.argmax(np.abs(np.fft.rfft(y))) * rate / y.size
    assert abs(peak_hz - 440) < 2, f"{fmt}: loudest at {peak_hz:.1f} Hz"
    rms_in = np.sqrt(np.mean(np.clip(x, -1, 1) ** 2))
    rms_out = np.sqrt(np.sum(y**2) / (x.size * rate / SR))  # over the input's duration: padding is silence
    assert abs(rms_out / rms_in - 1) < 0.1, f"{fmt}: rms {rms_out:.3f} vs input {rms_in:.3f}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_random_chunks_decode_to_the_input(fmt):
    _check_decoded(fmt, _stream(fmt, SINE, seed=1), STREAMED_EXTRA[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_all_decodes_to_the_input(fmt):
    _check_decoded(fmt, encode_all(fmt, SINE, SR), WHOLE_EXTRA[fmt])


def test_streamed_opus_is_mono_24k_ogg():
    data = _stream("opus", SINE)
    assert data.startswith(b"OggS")
    version, channels, _, input_rate = struct.unpack_from("<BBHI", data, data.index(b"OpusHead") + 8)
    assert (version, channels, input_rate) == (1, 1, SR)


@pytest.mark.parametrize("fmt", STREAMED)
def test_first_bytes_arrive_before_the_end(fmt):
    """After 0.5 s of audio, the bytes so far already decode to most of it: nothing waits for ``finish``."""
    enc = StreamEncoder(fmt, SR)
    head = b"".join(enc.encode(chunk) for chunk in _chunks(SINE[: SR // 2], seed=2))
    samples, rate = _decode(fmt, head)
    # held back: codec lookahead plus a part-filled frame (mp3, aac: ~0.1 s), or a 100 ms Ogg page plus
    # libopus's lookahead (opus: ~0.11 s)
    assert samples.size * SR // rate >= SR // 2 - (0 if fmt in ("pcm", "wav") else int(0.13 * SR))
    _check_decoded(fmt, head + enc.finish(), STREAMED_EXTRA[fmt], SINE[: SR // 2])


def test_streamed_flac_is_one_whole_file_with_its_length_that_soundfile_reads():
    """A FLAC whose header says "length unknown" (all a stream can send first) is one libsndfile cannot read:
    the streamed flac comes whole from ``finish``, its STREAMINFO holding the length."""
    assert WHOLE_FORMATS == ("flac",)
    enc = StreamEncoder("flac", SR)
    assert [enc.encode(chunk) for chunk in _chunks(SINE, seed=3)] == [b""] * len(_chunks(SINE, seed=3))
    data = enc.finish()
    assert data == encode_all("flac", SINE, SR)
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # the first metadata block: STREAMINFO
    assert int.from_bytes(data[8 + 13 : 8 + 18], "big") & (2**36 - 1) == N  # total samples (36 bits)
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == SR
    np.testing.assert_array_equal(samples, _quantised(SINE))


def test_streamed_wav_has_unknown_sizes_and_reads_with_soundfile():
    data = _stream("wav", SINE)
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert struct.unpack_from("<I", data, 4)[0] == 0xFFFFFFFF
    assert data[36:40] == b"data" and struct.unpack_from("<I", data, 40)[0] == 0xFFFFFFFF
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == SR
    np.testing.assert_array_equal(samples, _quantised(SINE))


def test_encode_all_wav_has_exact_sizes():
    data = encode_all("wav", SINE, SR)
    assert len(data) == 44 + 2 * N
    assert struct.unpack_from("<I", data, 4)[0] == 36 + 2 * N
    assert struct.unpack_from("<I", data, 40)[0] == 2 * N
    channels, rate, byte_rate, align, bits = struct.unpack_from("<HIIHH", data, 22)
    assert (channels, rate, byte_rate, align, bits) == (1, SR, 2 * SR, 2, 16)
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    np.testing.assert_array_equal(samples, _quantised(SINE))


def test_pcm_is_bare_s16le_scaled_by_32767():
    x = np.array([0.0, 1.0, -1.0, 0.5, -0.25, 2.0, -3.0], dtype=np.float32)
    expected = np.array([0, 32767, -32767, 16384, -8192, 32767, -32767], dtype="<i2").tobytes()
    assert encode_all("pcm", x) == expected
    enc = StreamEncoder("pcm")
    assert enc.encode(x[:3]) + enc.encode(x[3:3]) + enc.encode(x[3:]) + enc.finish() == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_float64_out_of_range_input_is_clipped(fmt):
    loud = 3.0 * SINE.astype(np.float64)  # [N], float64, mostly beyond [-1, 1]
    data = _stream(fmt, loud)
    if fmt in LOSSLESS:
        _check_decoded(fmt, data, STREAMED_EXTRA[fmt], loud)
    else:
        samples, _ = _decode(fmt, data)
        assert np.max(np.abs(samples)) < 1.3  # clipped to +-1 first; lossy codecs overshoot a little


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_stream_finishes(fmt):
    enc = StreamEncoder(fmt, SR)
    data = enc.encode(np.zeros(0, np.float32)) + enc.finish()
    assert enc.num_samples == 0
    if fmt == "pcm":
        assert data == b""
    elif fmt == "wav":
        assert len(data) == 44


def test_content_types_cover_every_format():
    assert set(CONTENT_TYPES) == set(FORMATS)
    assert CONTENT_TYPES["mp3"] == "audio/mpeg" and CONTENT_TYPES["opus"] == "audio/opus"


def test_unknown_format_names_the_allowed_ones():
    with pytest.raises(ValueError, match="mp3, opus, aac, flac, wav, pcm"):
        StreamEncoder("ogg")
    with pytest.raises(ValueError, match="unknown audio format"):
        encode_all("m4a", SINE)


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_encode_or_finish_after_finish_raises(fmt):
    enc = StreamEncoder(fmt, SR)
    enc.encode(SINE[:1000])
    enc.finish()
    with pytest.raises(ValueError, match="finished"):
        enc.encode(SINE[:1000])
    with pytest.raises(ValueError, match="finished"):
        enc.finish()


@pytest.mark.parametrize("bad", [np.zeros((2, 10), np.float32), np.zeros(10, np.int16)])
def test_rejects_non_float_or_multichannel_samples(bad):
    with pytest.raises(ValueError, match="1-D float"):
        StreamEncoder("pcm").encode(bad)


def test_without_pyav_compressed_formats_say_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # makes ``import av`` raise ImportError
    with pytest.raises(ImportError, match=r"chattts-velocity\[server\]"):
        StreamEncoder("mp3")
    enc = StreamEncoder("wav")  # pcm and wav need no PyAV
    assert enc.encode(SINE[:10]).startswith(b"RIFF")
