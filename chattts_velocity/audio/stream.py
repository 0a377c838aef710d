"""Incremental streaming decode: every chunk of GPT tokens is decoded once, with a bounded left context and
look-ahead, and keeps only its own samples, so a stream's decode work is linear in its length (re-decoding the
whole utterance at every chunk is quadratic).

Why this is (almost) exact: the Decoder/DVAE (k3 input convs, dilated k7 ConvNeXt blocks, k3 output conv) and
Vocos (k7 ConvNeXt stack, centred iSTFT) are convolutional with a finite receptive field, so a sample only
depends on the tokens within that field around it. A chunk decoded with L tokens of left context and R of
look-ahead equals the offline audio once L and R cover the field, and is close well before that;
``python benchmarks/stream_snr.py`` measures the SNR per L = R and the receptive field of full-size weights.

Sample alignment: global sample s of the offline wav belongs to token s // 512; a chunk [start, end) owns samples
[512 start, 512 end), except that a stream's final chunk stops at the offline length (2T - 1) * 256. A window of
W tokens from ctx_start decodes to (2W - 1) * 256 samples, local sample i being global sample 512 ctx_start + i.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..constants import HOP_LENGTH, SAMPLES_PER_TOKEN
from .decode import AudioDecoder


@dataclass(frozen=True)
class StreamConfig:
    """How a stream is cut into decode windows."""

    left_context: int = 8
    """L: tokens before the chunk decoded with it (>= 0); the chunk's start is exact once L covers the field.
    The decoders' convolutions are centred, so L errs at a chunk's start as R does at its end: past R = 8, more
    L changed the streamed audio by no more than float32 rounding (`benchmarks/stream_snr.py`; docs/perf/)."""
    lookahead: int = 8
    """R: tokens after the chunk that must exist before it is decoded (>= 0): latency traded for accuracy."""
    first_chunk: int = 8
    """Tokens in the first chunk (>= 1): first audio after first_chunk + lookahead tokens."""
    chunk: int = 24
    """Most tokens in a later chunk (>= 1): larger chunks spend less work on context, arrive later. Chunks
    grow up to it (each at most the tokens already emitted: 8, 8, 16, 24, ... by default), so a listener who
    starts playing at the first chunk never waits for the next while generation keeps up with real time."""

    def chunk_size(self, start: int) -> int:
        """Tokens of the chunk that starts at token ``start`` (before the stream's end cuts it): a chunk is
        never longer than the audio already out, so playback that starts with the first chunk does not run dry
        while the next one is generated at real time or faster."""
        return self.first_chunk if start == 0 else min(self.chunk, start)

    def head_tokens(self, chunks: int) -> int:
        """Tokens of a stream's first ``chunks`` chunks (8 + 8 = 16 for two, by default)."""
        start = 0
        for _ in range(chunks):
            start += self.chunk_size(start)
        return start

    def window_lengths(self) -> tuple[int, ...]:
        """Tokens of the windows a stream decodes: 16, 24, 32 and 40 by default, then 40 for every later
        chunk. The windows at a stream's end, cut short by it, take more left context to reach one of these
        lengths where the stream has the tokens (see ``AudioStream``)."""
        lengths, start = [], 0
        while True:
            size = self.chunk_size(start)
            n = min(start, self.left_context) + size + (self.lookahead or 1)  # lookahead 0: one zero token
            if n not in lengths:
                lengths.append(n)
            if size == self.chunk and start >= self.left_context:
                return tuple(lengths)
            start += size

    def __post_init__(self) -> None:
        for name, low in (("left_context", 0), ("lookahead", 0), ("first_chunk", 1), ("chunk", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StreamConfig.{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True, eq=False)
class Window:
    """One decode job: ``tokens[ctx_start:ctx_end]`` of one stream, of which the chunk [start, end) is kept."""

    stream: AudioStream
    """The stream whose ``accept`` takes the decoded samples."""
    pieces: tuple[Tensor, ...]
    """The window's input (hidden states or codes) in the pieces it was pushed in, [n_i, C] each, W tokens in
    all: views of the pushes, never copied here (``decode_windows`` copies a whole call's windows at once). One
    zero token is appended when there is no token after a non-final chunk (lookahead 0), because W tokens
    decode 256 samples short of 512 W."""
    length: int
    """W: the tokens the window decodes (its pieces' together)."""
    start: int
    """First token of the chunk (global index)."""
    end: int
    """One past the chunk's last token."""
    ctx_start: int
    """First token decoded: start - left_context, clipped at 0."""
    ctx_end: int
    """One past the last real token decoded: end + lookahead, clipped at the stream's end once it finished."""
    final: bool
    """The last window of its stream: its samples stop at the offline length."""

    @property
    def tokens(self) -> Tensor:
        """[W, C] the window's input as one tensor (a copy where it spans pushes)."""
        return self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces)


class AudioStream:
    """One request's incremental decoder state: the tokens pushed so far (only those still needed as context),
    which chunks have been handed out as windows, and which have been emitted as audio.

    A window that the stream's end cuts short (its look-ahead, or its chunk) starts earlier instead, by as many
    tokens as bring it to the next of ``StreamConfig.window_lengths`` (when the stream has them): more left
    context is only closer to the offline audio, and the windows of a round share a few lengths, each one
    decode call (the wav decode's CUDA graphs take every length up to the longest window, the odd ones for a
    few windows a call: ``audio.graphs``)."""

    def __init__(self, config: StreamConfig | None = None):
        self.config = config or StreamConfig()
        self._lengths = sorted(self.config.window_lengths())
        self.decoded_tokens = 0  # tokens run through the decoder (sum of window lengths): the decode work
        self._pushes: list[Tensor] = []  # the non-empty pushes still needed as context, as pushed (never copied)
        self._starts: list[int] = []  # the global index of each one's first token
        self._total = 0  # tokens pushed
        self._planned = 0  # tokens covered by windows that ready() returned
        self._emitted = 0  # tokens whose samples accept() returned
        self._finished = False

    @property
    def emitted(self) -> int:
        """Tokens whose samples ``accept`` has returned: the audio handed out so far."""
        return self._emitted

    @property
    def done(self) -> bool:
        """The request finished and every token's samples were emitted."""
        return self._finished and self._emitted == self._total

    def push(self, tokens: Tensor, finished: bool = False) -> None:
        """Append [n, C] new tokens (n may be 0; C, dtype and device are fixed by the first non-empty push).
        ``finished``: the request ended, so everything left is decodable without look-ahead. The tensor is read
        when its windows are decoded: do not overwrite it before."""
        if self._finished:
            raise ValueError("push after finished=True: this request has ended; start a new AudioStream")
        self._check(tokens)
        if tokens.shape[0]:
            self._pushes.append(tokens)
            self._starts.append(self._total)
            self._total += tokens.shape[0]
        self._finished = finished

    def ready(self) -> list[Window]:
        """Every window decodable now, in order; they leave the plan (the next call returns the next ones)."""
        if self._chunk_end() is None:
            return []
        windows = []
        while (window := self._next_window()) is not None:
            windows.append(window)
            self._planned = window.end
            self.decoded_tokens += window.length
        self._drop_old_tokens()
        return windows

    def accept(self, window: Window, wav: np.ndarray) -> np.ndarray:
        """``wav``: the decoded window's (2W - 1) * 256 samples -> the chunk's own samples, float32 1-D.
        Windows must be accepted in the order ``ready`` returned them, so the outputs concatenate."""
        if window.stream is not self:
            raise ValueError("accept got a window of another AudioStream")
        if window.start != self._emitted:
            raise ValueError(
                f"accept windows in the order ready() returned them: expected the chunk starting at token "
                f"{self._emitted}, got {window.start}"
            )
        want = (2 * window.length - 1) * HOP_LENGTH
        if not isinstance(wav, np.ndarray) or wav.shape != (want,):
            got = tuple(wav.shape) if isinstance(wav, np.ndarray) else type(wav).__name__
            raise ValueError(f"wav must be a 1-D numpy array of {want} samples for this window, got {got}")
        first = SAMPLES_PER_TOKEN * window.start
        stop = SAMPLES_PER_TOKEN * window.end - (HOP_LENGTH if window.final else 0)  # global samples
        base = SAMPLES_PER_TOKEN * window.ctx_start  # global index of wav[0]
        own = np.array(wav[first - base : stop - base], dtype=np.float32)
        assert own.size == stop - first, "a window must cover its chunk's samples"
        self._emitted = window.end
        return own

    def _check(self, tokens: Tensor) -> None:
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.shape[1] == 0:
            got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be a 2-D tensor [n, C] (hidden states or codes), got {got}")
        like = self._pushes[0] if self._pushes else None
        if like is None or tokens.shape[0] == 0:  # an empty push adds nothing, wherever it lives
            return
        if (tokens.shape[1], tokens.dtype, tokens.device) != (like.shape[1], like.dtype, like.device):
            got = f"[{tokens.shape[0]}, {tokens.shape[1]}] {tokens.dtype} on {tokens.device}"
            raise ValueError(
                f"tokens must be [n, {like.shape[1]}] {like.dtype} on {like.device} like the first "
                f"push, got {got}"
            )

    def _chunk_end(self) -> int | None:
        """One past the last token of the next window's chunk, or None if that window is not decodable yet
        (from the counts alone: nothing is concatenated)."""
        c, start, total = self.config, self._planned, self._total
        size = c.chunk_size(start)
        if not self._finished and start + size + c.lookahead > total:
            return None
        end = min(start + size, total)
        return None if end == start else end

    def _next_window(self) -> Window | None:
        if (end := self._chunk_end()) is None:
            return None
        c, start, total = self.config, self._planned, self._total
        ctx_start, ctx_end = max(0, start - c.left_context), min(end + c.lookahead, total)
        final = self._finished and end == total
        pad = ctx_end == end and not final  # lookahead 0: one zero token, as to_wavs pads shorter sequences
        n = ctx_end - ctx_start + pad
        longer = next((m for m in self._lengths if m >= n), n)
        if longer - n <= ctx_start:  # cut short by the stream's end: more left context, a usual length
            ctx_start -= longer - n
        pieces = self._slice(ctx_start, ctx_end)
        if pad:
            pieces.append(pieces[-1].new_zeros(1, pieces[-1].shape[1]))
        return Window(self, tuple(pieces), ctx_end - ctx_start + pad, start, end, ctx_start, ctx_end, final)

    def _slice(self, first: int, stop: int) -> list[Tensor]:
        """Global tokens [first, stop) as views of the pushes that hold them, in order."""
        i = max(bisect.bisect_right(self._starts, first) - 1, 0)
        pieces = []
        while i < len(self._pushes) and self._starts[i] < stop:
            push, at = self._pushes[i], self._starts[i]
            n = push.shape[0]
            whole = first <= at and at + n <= stop  # (a view costs a torch call)
            pieces.append(push if whole else push[max(first - at, 0) : min(stop - at, n)])
            i += 1
        return pieces

    def _drop_old_tokens(self) -> None:
        """Keep only the tokens the next window can read: from its left context (and as many more as a
        window cut short may take) on."""
        keep = max(0, self._planned - self.config.left_context - self._lengths[-1])  # (see the class)
        drop = bisect.bisect_right(self._starts, keep) - 1  # pushes wholly before ``keep``
        if drop > 0:
            del self._pushes[:drop], self._starts[:drop]


def decode_windows(
    audio: AudioDecoder, windows: list[Window], use_decoder: bool, tf32: bool | None = None
) -> list[np.ndarray]:
    """Decode many windows (of many streams) in as few Decoder+Vocos calls as possible: windows of equal length
    share one batched ``AudioDecoder.to_wavs`` call (so no zero padding reaches their audio); returns each
    window's (2W - 1) * 256 samples, in order, for ``Window.stream.accept``."""
    by_len: dict[int, list[int]] = {}
    for i, window in enumerate(windows):
        by_len.setdefault(window.length, []).append(i)
    wavs: list[np.ndarray | None] = [None] * len(windows)
    for length, idx in by_len.items():
        # the call's windows in one copy: their pieces end to end are the windows stacked, [B * W, C]
        stacked = torch.cat([p for i in idx for p in windows[i].pieces])
        batch = audio.to_wavs_stacked(stacked.view(len(idx), length, -1), use_decoder, tf32)  # [B, (2W-1)*256]
        for i, wav in zip(idx, batch, strict=True):
            wavs[i] = wav
    return wavs
