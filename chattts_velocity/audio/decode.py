"""From GPT outputs to waveforms (and from a waveform to speaker-sample codes), batched like upstream's
``Chat._decode_to_wavs`` so the samples match it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from vocos import Vocos

from ..constants import HOP_LENGTH
from ..cpu_threads import on_own_thread
from ..device import wait_for
from .dvae import DVAE
from .graphs import DecodeGraphs
from .vocoder import vocos_decode


def _to_host(x: Tensor) -> np.ndarray:
    """A device tensor's values as a numpy array. From CUDA through page-locked memory of torch's caching host
    allocator: a copy into pageable memory was slow and varied widely between runs (`benchmarks/wav_decode.py`;
    docs/perf/); the array is a view of the pinned block, which returns to torch's cache when the array is
    freed."""
    if x.device.type != "cuda":
        return x.cpu().numpy()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    wait_for(torch.cuda.current_stream(x.device))
    return host.numpy()


DECODE_TOKENS = 131_072
"""Padded steps (sequences x the longest's length) that one ``AudioDecoder.to_wav_list`` batch holds at most:
256 sequences of 512 steps; longer lists decode in several batches, bounding the decode's activations."""


class AudioDecoder:
    """Codes or hidden states -> mel (DVAE or Decoder) -> wav (Vocos).

    ``tf32``: on CUDA, run the float32 matmuls and convolutions of the wav decode on TF32 tensor cores, and its
    ConvNeXt blocks on the fused channels-last kernels where ``audio.convnext.fused_default`` allows
    (``audio.convnext``: float16 activations, float32 sums and residual stream); measured from torch's default
    settings (TF32 convolutions only) the wavs move about as little this way as in strict float32
    (`benchmarks/wav_decode.py`; docs/perf/). The setting is restored after every decode; ``tf32=False`` runs
    upstream's torch ops at torch's own precision settings.
    """

    def __init__(self, dvae: DVAE, decoder: DVAE, vocos: Vocos, device: torch.device | str, tf32: bool = True,
                 mixed_lengths: bool | None = None):
        self.dvae = dvae
        self.decoder = decoder
        self.vocos = vocos
        self.device = torch.device(device)
        self.tf32 = tf32
        self.mixed_lengths = self.device.type == "cuda" if mixed_lengths is None else mixed_lengths
        """Whether ``to_wav_list`` decodes sequences of different lengths in one batch (default: on CUDA)."""
        self._side = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.graphs: DecodeGraphs | None = None
        """CUDA graphs of the Decoder path for batches of stream windows (``use_graphs``); None: eager."""

    def use_graphs(self, lengths, capture: bool = False) -> None:
        """Decode batches of equal-length hidden-state windows of these lengths (tokens) by CUDA graph replay
        (see ``audio.graphs``): on CUDA only, where the Decoder and Vocos share the device; ``capture``: capture
        every bucket now rather than at first use (a capture synchronizes the device and collects garbage)."""
        devices = (self.device, next(self.vocos.parameters()).device, self.decoder.coef.device)
        if any(d.type != "cuda" for d in devices):
            return
        indices = {torch.cuda.current_device() if d.index is None else d.index for d in devices}
        if len(indices) != 1:
            return
        if self.graphs is None or self.graphs.lengths != frozenset(lengths):
            self.graphs = DecodeGraphs(self.decoder, self.vocos, torch.device("cuda", indices.pop()), lengths)
        if capture:
            with torch.inference_mode(), self._precision(self.tf32), self.stream():
                self.graphs.capture(self.tf32)

    @property
    def cuda_stream(self) -> torch.cuda.Stream | None:
        """The decoder's own CUDA stream (``stream``); None off CUDA."""
        return self._side

    def stream(self) -> contextlib.AbstractContextManager:
        """Run the decodes of this block on the decoder's own high-priority CUDA stream (a no-op on the CPU).
        On the engine's stream a decode's few hundred kernels queue behind, and interleave with, the decode
        windows the engine keeps queuing, so a stream's first chunk waited for the whole generation
        (`python benchmarks/stream_latency.py`). Only for tensors whose producing work has finished, as the
        engine's outputs have (it reports tokens after their window completed): nothing orders this stream
        after the one that produced its inputs."""
        return torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()

    def hold(self, x) -> None:
        """Keep a device tensor made on another CUDA stream (the engine's outputs) from being reused there until
        the work this decoder's stream has queued by the time it is freed is done (a no-op off CUDA). A pump's
        thread (``AudioPump.thread``) decodes while the engine allocates, so a freed input's memory could be
        rewritten before this stream read it; between the engine's steps each round ends synchronized."""
        if self._side is not None and isinstance(x, Tensor) and x.is_cuda:
            x.record_stream(self._side)

    @torch.inference_mode()
    def to_wavs(self, results: list[Tensor], use_decoder: bool, tf32: bool | None = None) -> np.ndarray:
        """Per-sequence [T_i, C] tensors (hidden states [T_i, H] if ``use_decoder``, else codes [T_i, G*R]) ->
        float32 wavs [B, S], all as long as the longest (shorter ones decode their zero padding too).
        ``tf32`` overrides the decoder's setting for this call."""
        if not results:
            return np.array([], dtype=np.float32)
        return self._decode(*self._pad(results), use_decoder, tf32)

    @torch.inference_mode()
    def to_wavs_stacked(self, stacked: Tensor, use_decoder: bool, tf32: bool | None = None) -> np.ndarray:
        """``to_wavs`` of B sequences of one length already in one tensor [B, T, C] (stream windows: no copy per
        sequence)."""
        if stacked.dim() != 3 or stacked.shape[0] == 0:
            raise ValueError(f"stacked must be a non-empty [B, T, C] tensor, got {tuple(stacked.shape)}")
        return self._decode(stacked.to(self.device).transpose(1, 2), True, use_decoder, tf32)

    def _decode(self, batch: Tensor, equal: bool, use_decoder: bool, tf32: bool | None,
                lengths: Tensor | None = None) -> np.ndarray:
        """[B, C, T] (a view is fine) -> float32 wavs [B, S] on the host; ``equal``: no row is padded;
        ``lengths`` [B] int32 on the device: each row's own number of steps, its padding read as zeros (row b
        then holds its own wav in its first ``HOP_LENGTH * (2 * lengths[b] - 1)`` samples)."""
        tf32 = self.tf32 if tf32 is None else tf32
        with self._precision(tf32):
            # stream windows (one length, no padding): a CUDA graph replay where one takes the shape
            wav = self.graphs.run(batch, tf32) if self.graphs is not None and use_decoder and equal else None
            if wav is not None:
                return _to_host(wav)
            mel = (self.decoder if use_decoder else self.dvae).decode(batch.contiguous(), lengths)  # [B, n_mels, 2T]
            vocos_device = next(self.vocos.parameters()).device
            frames = None if lengths is None else 2 * lengths.to(vocos_device)
            wav = vocos_decode(self.vocos, mel.to(vocos_device), frames)
        return _to_host(wav.float())  # [B, S]

    @torch.inference_mode()
    def to_wav_list(self, results: list[Tensor], use_decoder: bool, tf32: bool | None = None) -> list[np.ndarray]:
        """Like ``to_wavs``, but every sequence is decoded at its own length (no padding reaches its audio).
        On CUDA sequences of different lengths share a batch in which every convolution, and the iSTFT, reads a
        row's frames past its own length as zeros (the decode of each row alone, to rounding): the batches are
        runs of similar lengths (sorted) of at most ``DECODE_TOKENS`` padded steps. On the CPU, where the
        padding would cost its full compute, a batch holds sequences of one length (``mixed_lengths``)."""
        wavs: list[np.ndarray | None] = [None] * len(results)
        order = sorted(range(len(results)), key=lambda i: results[i].shape[0])
        mixed = self.mixed_lengths
        chunk: list[int] = []
        for i in order:
            length = results[i].shape[0]
            if length == 0:
                wavs[i] = np.zeros(0, dtype=np.float32)
                continue
            if chunk and ((len(chunk) + 1) * length > DECODE_TOKENS
                          or not (mixed or results[chunk[-1]].shape[0] == length)):
                self._decode_rows(results, chunk, use_decoder, tf32, wavs)
                chunk = []
            chunk.append(i)
        if chunk:
            self._decode_rows(results, chunk, use_decoder, tf32, wavs)
        return wavs

    def _decode_rows(self, results: list[Tensor], idx: list[int], use_decoder: bool, tf32: bool | None,
                     wavs: list[np.ndarray | None]) -> None:
        """``to_wav_list`` of ``results[i] for i in idx`` in one batch, into ``wavs[i]``."""
        rows = [results[i] for i in idx]
        batch, equal = self._pad(rows)
        lengths = None
        if not equal:
            lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int32).to(self.device, non_blocking=True)
        decoded = self._decode(batch, equal, use_decoder, tf32, lengths)
        for i, row, wav in zip(idx, rows, decoded, strict=True):
            wavs[i] = wav if equal else wav[: HOP_LENGTH * (2 * row.shape[0] - 1)]

    @torch.inference_mode()
    def sample_audio(self, wav: np.ndarray | Tensor) -> Tensor:
        """Mono 24 kHz wav [S] float -> speaker-sample codes [G*R, T] int32 (``DVAE.encode`` checks the input)."""
        if isinstance(wav, np.ndarray):
            if wav.dtype.kind != "f":
                raise ValueError(f"wav must hold floats, got numpy {wav.dtype}")
            wav = torch.from_numpy(np.ascontiguousarray(wav))
        if not isinstance(wav, Tensor):
            raise ValueError(f"wav must be a numpy array or a torch tensor, got {type(wav).__name__}")
        return self.dvae.encode(wav.to(self.device))

    @contextlib.contextmanager
    def _precision(self, tf32: bool) -> Iterator[None]:
        if not (tf32 and self.device.type == "cuda"):
            yield
            return
        matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
        saved = matmul.fp32_precision, conv.fp32_precision
        matmul.fp32_precision = conv.fp32_precision = "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision, conv.fp32_precision = saved

    def _pad(self, results: list[Tensor]) -> tuple[Tensor, bool]:
        """Right-zero-pad [T_i, C] tensors into one [B, C, max T_i] batch on the device; and whether every T_i
        is the same (no padding)."""
        width = results[0].shape[-1]
        for i, r in enumerate(results):
            if r.dim() != 2 or r.shape[1] != width:
                expected = f"expected [T, {width}] like results[0]"
                raise ValueError(f"results[{i}] has shape {tuple(r.shape)}, {expected}")
        longest = max(r.shape[0] for r in results)
        equal = all(r.shape[0] == longest for r in results)
        first = results[0]
        if (equal and first.device.type == self.device.type
                and all((r.dtype, r.device) == (first.dtype, first.device) for r in results)):
            # equal lengths: one stack, not one copy per row
            return torch.stack(results).transpose(1, 2), True
        batch = torch.zeros((len(results), width, longest), dtype=results[0].dtype, device=self.device)
        for row, r in zip(batch, results, strict=True):
            row[:, : r.shape[0]].copy_(r.T)
        return batch, equal


class SharedDecode:
    """``AudioDecoder.to_wav_list`` shared by concurrent callers (``Pipeline.speak`` on many threads, as ``synth``
    runs it): while one decode runs, the sequences of calls that arrive wait, and the next decode takes every
    waiting call's sequences in one ``to_wav_list`` (on CUDA rows of different lengths share batches),
    instead of one decode per call queuing on the GPU. The caller that finds no decode running runs it, on the decoder's
    stream (on the CPU on a thread of its own, ``on_own_thread``); each call gets its own wavs, or the error of
    the decode that held its sequences. No thread of its own: nothing runs while no call waits.

    Calls announced with ``expecting`` (generating, their decode to come) are gathered: a decode about to start
    while some of them have not arrived waits for them as long as they keep arriving, ``GATHER_QUIET_S`` apart,
    at most ``GATHER_MAX_S``, so that requests finishing in one engine step (a wave of equal lengths) share one
    decode instead of the first to wake decoding alone."""

    GATHER_QUIET_S = 0.005
    GATHER_MAX_S = 0.05

    def __init__(self, audio: AudioDecoder):
        self.audio = audio
        self._cond = threading.Condition()
        self._waiting: list[_Call] = []
        self._running = False
        self._expected = 0
        self.decodes = 0
        """How many decodes ran (each for one or more calls)."""

    @contextlib.contextmanager
    def expecting(self) -> Iterator[_Expected]:
        """Around a call's generation and its ``to_wav_list`` (given what this yields): a decode about to start
        may wait for it."""
        expected = _Expected()
        with self._cond:
            self._expected += 1
        try:
            yield expected
        finally:
            with self._cond:
                if not expected.arrived:  # its generation failed: it will not come
                    expected.arrived = True
                    self._expected -= 1
                    self._cond.notify_all()

    def to_wav_list(self, results: list[Tensor], use_decoder: bool,
                    expected: _Expected | None = None) -> list[np.ndarray]:
        """Each sequence's wav (``AudioDecoder.to_wav_list``), decoded with those of the calls waiting at the
        time; ``expected``: this call's ``expecting``."""
        call = _Call(results, use_decoder)
        with self._cond:
            if expected is not None and not expected.arrived:
                expected.arrived = True
                self._expected -= 1
            self._waiting.append(call)
            self._cond.notify_all()  # a decode gathering its calls sees this one
            while self._running and not call.finished:
                self._cond.wait()
            if call.finished:
                return call.outcome()
            self._running = True
            self._gather()
            calls, self._waiting = self._waiting, []
            self.decodes += 1
        try:
            self._decode(calls)
        finally:  # even when this thread is interrupted: no call waits for a decode that will not come
            with self._cond:
                for c in calls:
                    c.finished = True
                self._running = False
                self._cond.notify_all()
        return call.outcome()

    def _gather(self) -> None:
        """(Holding the lock.) While expected calls are still generating, wait for them as long as they keep
        arriving (see the class)."""
        now = time.monotonic()
        deadline, last, seen = now + self.GATHER_MAX_S, now, len(self._waiting)
        while self._expected > 0:
            now = time.monotonic()
            if len(self._waiting) > seen:
                last, seen = now, len(self._waiting)
            left = min(deadline, last + self.GATHER_QUIET_S) - now
            if left <= 0:
                return  # none arrived within the quiet time (the rest finish later), or waited long enough
            self._cond.wait(left)

    def _decode(self, calls: list[_Call]) -> None:
        for use_decoder in {c.use_decoder for c in calls}:
            group = [c for c in calls if c.use_decoder == use_decoder]
            rows = [r for c in group for r in c.results]
            try:
                with self.audio.stream():
                    wavs = on_own_thread(self.audio.device, self.audio.to_wav_list, rows, use_decoder)
            except BaseException as err:  # noqa: BLE001 - raised by each call whose sequences it held
                for c in group:
                    c.error = err
                continue
            start = 0
            for c in group:
                c.wavs, start = wavs[start: start + len(c.results)], start + len(c.results)


class _Expected:
    """A call announced by ``SharedDecode.expecting``; ``arrived`` once its ``to_wav_list`` came (or it failed)."""

    def __init__(self):
        self.arrived = False


class _Call:
    """One ``SharedDecode.to_wav_list`` call: its sequences, then its wavs or its decode's error."""

    def __init__(self, results: list[Tensor], use_decoder: bool):
        self.results, self.use_decoder = results, use_decoder
        self.wavs: list[np.ndarray] | None = None
        self.error: BaseException | None = None
        self.finished = False

    def outcome(self) -> list[np.ndarray]:
        if self.error is not None:
            raise self.error
        if self.wavs is None:
            raise RuntimeError("the shared wav decode holding these sequences was interrupted")
        return self.wavs
