"""Incremental encoders for OpenAI's ``response_format``s: float32 mono chunks in, bytes to send out.

``pcm`` and ``wav`` are written here (int16 samples, a 44-byte RIFF header); mp3, opus, aac and flac go
through PyAV (FFmpeg), imported lazily so the rest of the package works without it. Every format carries the
same int16 quantisation of the input, so lossless formats decode to exactly ``_pcm16(samples)``. Every format
but flac streams (``WHOLE_FORMATS``).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

FORMATS: tuple[str, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")

CONTENT_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
"""The ``Content-Type`` per format: the types api.openai.com's ``/v1/audio/speech`` answers with (and that
OpenAI-compatible servers mirror), so clients that switch on the header behave as they do against OpenAI.
``opus`` is Ogg-encapsulated all the same; OpenAI labels it ``audio/opus``, not ``audio/ogg;codecs=opus``."""

WHOLE_FORMATS: tuple[str, ...] = ("flac",)
"""Formats whose bytes all come at the end of a stream, as one complete file: a FLAC's header (STREAMINFO) holds
its length, which only a seekable output can fill in once the audio is done, and libsndfile (``soundfile``)
cannot read a FLAC whose header says the length is unknown. wav and pcm stream the same lossless samples."""

_UNKNOWN_SIZE = 0xFFFFFFFF
"""RIFF and data chunk size of a streamed WAV, whose length is unknown when the header is sent."""


@dataclass(frozen=True)
class _Codec:
    """How one compressed format is made with PyAV."""

    container: str
    """FFmpeg muxer name."""
    codec: str
    """FFmpeg encoder name."""
    bit_rate: int | None
    """Target bits per second; None for lossless."""
    options: dict[str, str]
    """Muxer options."""


_CODECS: dict[str, _Codec] = {
    # MPEG-2 layer III (24 kHz) allows 8-160 kb/s; 64 kb/s mono is clean speech. No ID3 tag: a stream of bare
    # MPEG frames can be cut and concatenated anywhere.
    "mp3": _Codec("mp3", "libmp3lame", 64_000, {"id3v2_version": "0"}),
    # Opus is near-transparent for speech at 32 kb/s and takes 24 kHz natively. The Ogg muxer holds packets
    # until a page lasts page_duration (default 1 s, which can hold back a whole short clip): 100 ms pages cost
    # little in page headers and bound the added latency.
    "opus": _Codec("ogg", "libopus", 32_000, {"page_duration": "100000"}),
    # FFmpeg's native AAC-LC at 64 kb/s, in ADTS: self-framed, so it needs no seekable container.
    "aac": _Codec("adts", "aac", 64_000, {}),
    # No PADDING block (FFmpeg's default is 8 KiB): it serves later tag edits, not a stream.
    "flac": _Codec("flac", "flac", None, {"metadata_header_padding": "0"}),
}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown audio format {fmt!r}: pick one of {', '.join(FORMATS)}")


def _pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples -> int16: clipped to [-1, 1], scaled by 32767, rounded (so +-1.0 map to +-32767)."""
    samples = np.asarray(samples)
    if samples.ndim != 1 or not np.issubdtype(samples.dtype, np.floating):
        raise ValueError(f"expected 1-D float samples, got a {samples.dtype} array of shape {samples.shape}")
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")


def _wav_header(sample_rate: int, num_samples: int | None) -> bytes:
    """A 44-byte RIFF/WAVE header for s16le mono; ``num_samples=None`` writes the streaming sizes."""
    data = _UNKNOWN_SIZE if num_samples is None else 2 * num_samples
    riff = _UNKNOWN_SIZE if num_samples is None else 36 + data
    # fmt chunk: 16 bytes; PCM, mono, rate, byte rate, block align, bits per sample
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16)
    return b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", data)


def _import_av():
    try:
        import av
    except ImportError as e:
        msg = ('encoding mp3, opus, aac or flac needs PyAV: pip install -e ".[server]" from a clone, or '
               '"chattts-velocity[server]" from an index')
        raise ImportError(msg) from e
    return av


class _Sink:
    """A write-only file: PyAV sees no ``seek``, so its muxers stream (and flush after every packet)."""

    def __init__(self) -> None:
        self._data = bytearray()

    def write(self, data) -> int:
        self._data += data
        return len(data)

    def take(self) -> bytes:
        """The bytes written since the last ``take``."""
        data = bytes(self._data)
        self._data.clear()
        return data


class _Muxer:
    """One PyAV output container holding one mono stream of ``fmt``, written into ``file``.

    Frames are handed over as s16 of any length: PyAV's encoder front-end converts them to the codec's sample
    format (losslessly: s16 -> float is exact) and cuts ``frame_size`` frames, keeping the remainder for the
    next call; only the last, short frame is padded, by the codec, at ``close``.
    """

    def __init__(self, fmt: str, sample_rate: int, file) -> None:
        self._av = _import_av()
        codec = _CODECS[fmt]
        self._container = self._av.open(file, "w", format=codec.container, options=codec.options)
        self._stream = self._container.add_stream(codec.codec, rate=sample_rate, layout="mono")
        if codec.bit_rate is not None:
            self._stream.bit_rate = codec.bit_rate
        self._container.start_encoding()  # Ogg and FLAC headers go out with the first chunk, not frame
        self._time_base = Fraction(1, sample_rate)
        self._pts = 0

    def write(self, pcm: np.ndarray) -> None:
        frame = self._av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")  # [1, n]
        frame.sample_rate = self._time_base.denominator
        frame.pts, frame.time_base = self._pts, self._time_base
        self._pts += pcm.size
        self._container.mux(self._stream.encode(frame))

    def close(self) -> None:
        """Drain the encoder (codec delay, the last short frame) and write the container trailer."""
        self._container.mux(self._stream.encode(None))
        self._container.close()


class StreamEncoder:
    """Encodes float32 mono chunks into one ``fmt`` stream, incrementally: the concatenation of everything
    ``encode`` and ``finish`` return is a valid file of that format.

    Streamed WAV has RIFF and data sizes 0xFFFFFFFF (unknown length), as streaming TTS servers send it;
    FFmpeg, libsndfile (``soundfile``) and Python's ``wave`` all read it to the end of the bytes. Streamed mp3
    has no LAME/Xing tag (it is written by seeking back), so decoders keep the encoder delay; ``encode_all``
    has it. A ``WHOLE_FORMATS`` stream (flac) is encoded as the chunks come but returned only by ``finish``,
    whole: the bytes of ``encode_all``.
    """

    num_samples: int
    """Samples consumed so far."""

    def __init__(self, fmt: str, sample_rate: int = 24000) -> None:
        _check_format(fmt)
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        self.fmt, self.sample_rate = fmt, sample_rate
        self.num_samples = 0
        self._out = _Sink()
        self._whole = io.BytesIO() if fmt in WHOLE_FORMATS else None  # seekable: the muxer rewrites the header
        file = self._out if self._whole is None else self._whole
        self._muxer = _Muxer(fmt, sample_rate, file) if fmt in _CODECS else None
        if fmt == "wav":
            self._out.write(_wav_header(sample_rate, None))
        self._finished = False

    def encode(self, samples: np.ndarray) -> bytes:
        """Consume ``samples`` (1-D float, any length, clipped to [-1, 1]); return the bytes ready so far,
        which may be b"" while a codec fills a frame or the Ogg muxer a page (always, for ``WHOLE_FORMATS``)."""
        self._check_open()
        pcm = _pcm16(samples)
        self.num_samples += pcm.size
        if pcm.size and self._muxer is not None:
            self._muxer.write(pcm)
        elif pcm.size:
            self._out.write(pcm.tobytes())
        return self._out.take()

    def finish(self) -> bytes:
        """The rest of the stream: the codec's buffered audio and the container trailer. Ends the encoder."""
        self._check_open()
        self._finished = True
        if self._muxer is not None:
            self._muxer.close()
        if self._whole is not None:
            self._out.write(self._whole.getvalue())
        return self._out.take()

    def _check_open(self) -> None:
        if self._finished:
            raise ValueError("this StreamEncoder has finished: start a new one for a new stream")


def encode_all(fmt: str, samples: np.ndarray, sample_rate: int = 24000) -> bytes:
    """Whole-file encoding (non-streamed responses). Unlike the streamed form, the container may seek back:
    WAV gets exact sizes, mp3 a LAME tag (decoders trim the encoder delay), FLAC a STREAMINFO with the length
    and MD5."""
    _check_format(fmt)
    pcm = _pcm16(samples)
    if fmt == "pcm":
        return pcm.tobytes()
    if fmt == "wav":
        return _wav_header(sample_rate, pcm.size) + pcm.tobytes()
    file = io.BytesIO()
    muxer = _Muxer(fmt, sample_rate, file)
    if pcm.size:
        muxer.write(pcm)
    muxer.close()
    return file.getvalue()
