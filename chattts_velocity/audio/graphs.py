"""CUDA graphs of the wav decode of stream windows: Decoder (hidden states -> mel) + Vocos (mel -> wav) over a
batch of equal-length windows, one graph per (window length, batch bucket, TF32 setting).

Why: eagerly, one decode call is a few hundred kernel launches from Python, and a stream window's batch is
small, so the call is bound by them, whatever the batch. A replay is one launch, several times faster for a
few windows and bit-identical (`python benchmarks/wav_decode.py`; docs/perf/).

The graph computes exactly the eager ops, with one change: Vocos's "center" iSTFT (``torch.istft``, which checks
the window envelope on the host and so cannot be captured) is written out as inverse FFT, overlap-add and the
division by the window envelope (precomputed per length). Rows past a batch's size are zeros; each row of
the decode is independent of the others (convolutions over time, per-frame linears).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch
from torch import Tensor
from vocos import Vocos

from .convnext import vocos_backbone
from .dvae import DVAE
from .vocoder import head_spectrum, istft_center, window_envelope

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Batch sizes a graph is captured for; a batch runs in the buckets that ``cover`` picks."""
SHORT_BUCKETS = (1, 2, 4, 8)
"""Batch sizes captured for the other lengths up to the longest window: only a stream shorter than a window
length ends in one of them (its last windows cannot take more left context), a few streams a round. Eagerly,
such a call was one of a loaded server's slowest in a round (new shapes: `chattts-velocity bench serve`;
docs/perf/), and the round, which every request's first audio in it waits for, with it."""
REPLAY_TOKENS = 448
"""What one more replay costs, in window tokens decoded (``cover``'s price of a replay): a replay has a fixed
cost however few its windows, worth this many tokens of windows in a large bucket, fitted to the replay times
of every bucket at two window lengths (`python benchmarks/wav_decode.py --buckets 16 40`; docs/perf/stream.md)."""


@functools.cache
def cover(batch: int, buckets: tuple[int, ...], replay_windows: int) -> tuple[int, ...]:
    """The buckets, largest first, whose replays decode ``batch`` windows at the least cost: the windows they
    decode (the zero windows that pad the last one included) plus ``replay_windows`` a replay; of equal costs,
    the fewest replays. The smallest bucket that holds a batch decodes up to twice its windows (130 windows in
    256: 126 of zeros), where 128 + 2 decode none; a batch past the largest bucket takes it as often as it
    fills it."""
    if batch < 1 or not buckets:
        raise ValueError(f"cover needs a batch >= 1 and buckets, got {batch} and {buckets}")
    cost = [(0, 0)] * (batch + 1)  # for n windows left: (least cost, its replays)
    choice = [0] * (batch + 1)  # its first bucket
    for n in range(1, batch + 1):
        options = []
        for b in buckets:
            rest_cost, rest_replays = cost[max(n - b, 0)]
            options.append(((rest_cost + b + replay_windows, rest_replays + 1), b))
        cost[n], choice[n] = min(options)
    parts, n = [], batch
    while n > 0:
        parts.append(choice[n])
        n -= choice[n]
    return tuple(sorted(parts, reverse=True))


def decode_wav(decoder: DVAE, vocos: Vocos, x: Tensor, envelope: Tensor | None = None) -> Tensor:
    """Hidden states [B, H, T] -> wav [B, (2T - 1) * 256]: ``vocos.decode(decoder.decode(x))`` with the head's
    iSTFT as ``istft_center``."""
    istft = vocos.head.istft
    spec = head_spectrum(vocos.head, vocos_backbone(vocos.backbone, decoder.decode(x)))  # [B, n_fft / 2 + 1, F]
    return istft_center(spec, istft.n_fft, istft.hop_length, istft.window, envelope)


class DecodeGraphs:
    """The captured decodes of one Decoder + Vocos on one CUDA device. ``run`` captures a missing graph on
    first use (``capture`` does it ahead, e.g. while a server warms up)."""

    def __init__(self, decoder: DVAE, vocos: Vocos, device: torch.device, lengths: Iterable[int]):
        self.decoder, self.vocos, self.device = decoder, vocos, device
        self.lengths = frozenset(lengths)
        """Window lengths (tokens) of a stream's windows: graphs of every batch bucket (``BATCH_BUCKETS``)."""
        self.short_lengths = frozenset(range(1, max(self.lengths, default=0))) - self.lengths
        """The other lengths below the longest: graphs of a few windows (``SHORT_BUCKETS``), for the last
        windows of the streams shorter than a window length (the others take more context to one of
        ``lengths``, see ``AudioStream``). Longer windows run eagerly."""
        self.width = 2 * decoder.config.decoder.idim
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]] = {}
        """(length, bucket, tf32) -> the graph, its input and output buffers, and the envelope it reads (held
        here: a graph reads its tensors' memory, which must outlive it)."""
        self._pool = None
        self.capture_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        """The stream these graphs are captured on, not torch's default capture stream, which captures the
        engine's: a GEMM captured into a graph keeps the cuBLAS workspace of the (thread, stream) it was
        captured on, so graphs captured on one stream share one workspace; replayed at once on two streams (the
        engine's window on its stream, a decode on the decoder's), such graphs each started and never finished,
        the GPU busy. torch draws streams from pools by priority, so a high-priority one is never the default
        capture stream (priority 0)."""

    def buckets(self, length: int) -> tuple[int, ...]:
        """The batch buckets captured for windows of ``length`` tokens (none: eager)."""
        return BATCH_BUCKETS if length in self.lengths else SHORT_BUCKETS if length in self.short_lengths else ()

    def plan(self, batch: int, length: int) -> tuple[int, ...]:
        """The buckets a batch of ``batch`` windows of ``length`` tokens replays in, in order (``cover``: the
        first windows in the first bucket, and so on); empty: eager."""
        buckets = self.buckets(length)
        return cover(batch, buckets, -(-REPLAY_TOKENS // length)) if buckets else ()

    def run(self, x: Tensor, tf32: bool) -> Tensor | None:
        """Windows [B, H, T] -> wav [B, S], or None if no graph takes windows of T tokens. A batch of one
        replay returns a view of the graph's output buffer, valid until the next replay of that graph (copy it
        out before); one of several replays, a tensor of its own."""
        b, _, t = x.shape
        parts = self.plan(b, t)
        if not parts:
            return None
        if len(parts) == 1:
            return self._replay(x, parts[0], tf32)
        wav = None
        start = 0
        for bucket in parts:  # each part's wav copied out before the next replay (one stream: in order)
            part = self._replay(x[start : start + bucket], bucket, tf32)
            if wav is None:
                wav = torch.empty((b, part.shape[1]), dtype=part.dtype, device=part.device)
            wav[start : start + part.shape[0]].copy_(part)
            start += part.shape[0]
        return wav

    def _replay(self, x: Tensor, bucket: int, tf32: bool) -> Tensor:
        """Windows [n <= bucket, H, T] through the bucket's graph (zero windows after them): a view of its
        output."""
        n, _, t = x.shape
        graph, inp, out, _ = self._graphs.get((t, bucket, tf32)) or self._capture(t, bucket, tf32)
        inp[:n].copy_(x)
        inp[n:].zero_()
        graph.replay()
        return out[:n]

    def capture(self, tf32: bool) -> None:
        """Capture every graph not captured yet (every length's buckets)."""
        for t in sorted(self.lengths | self.short_lengths):
            for b in self.buckets(t):
                if (t, b, tf32) not in self._graphs:
                    self._capture(t, b, tf32)

    def _capture(self, t: int, bucket: int, tf32: bool):
        inp = torch.zeros(bucket, self.width, t, device=self.device)
        window = self.vocos.head.istft.window
        envelope = window_envelope(window, 2 * t, self.vocos.head.istft.hop_length)
        side = self.capture_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up (cuDNN, cuFFT plans) before the capture, as torch advises
            decode_wav(self.decoder, self.vocos, inp, envelope)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: other threads (the engine's reports, pinned copies) may use CUDA during the capture
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            out = decode_wav(self.decoder, self.vocos, inp, envelope)
        self._pool = graph.pool()
        self._graphs[t, bucket, tf32] = graph, inp, out, envelope
        logger.debug("captured the wav decode of %d windows of %d tokens", bucket, t)
        return self._graphs[t, bucket, tf32]
