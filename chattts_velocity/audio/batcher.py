"""``WindowBatcher``: the stream decode windows of every caller, decoded together on one decoder thread. Each
caller (a thread streaming one ``infer`` call, a server request) hands its windows to ``decode`` and waits;
the decoder thread takes every window queued by then, from all callers, and runs them as one batched
Decoder + Vocos call per window length, then hands each caller its samples. Under load the windows of many
streams share one call (on a GPU a batch of 32 windows costs about what one does); alone, a caller's windows
are decoded at once. One thread does all the decoding, so per-thread state (CUDA stream, oneDNN scratch
memory) exists once, not once per caller thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .decode import AudioDecoder
from .stream import Window, decode_windows


@dataclass(eq=False)
class _Job:
    windows: list[Window]
    use_decoder: bool
    wavs: list[np.ndarray] | None = None
    error: BaseException | None = None
    done: bool = False


class WindowBatcher:
    def __init__(self, audio: AudioDecoder):
        self.audio = audio
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._thread: threading.Thread | None = None
        self.num_calls = 0
        """Batched decode rounds run so far (a round is one ``decode_windows`` call per decoder kind)."""

    def decode(self, windows: list[Window], use_decoder: bool) -> list[np.ndarray]:
        """Each window's (2W - 1) * 256 samples, in order (``decode_windows``), batched with other callers'."""
        if not windows:
            return []
        job = _Job(windows, use_decoder)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="chattts-velocity-decoder", daemon=True)
                self._thread.start()
            self._queue.append(job)
            self._cond.notify_all()
            while not job.done:
                self._cond.wait()
        if job.error is not None:
            raise job.error
        return job.wavs

    def _loop(self) -> None:
        with self.audio.stream():
            while True:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    batch, self._queue = self._queue, []
                try:
                    self._run(batch)
                except BaseException as err:  # noqa: BLE001 - every caller of the round sees the failure
                    for job in batch:
                        job.error = err
                with self._cond:
                    for job in batch:
                        job.done = True
                    self._cond.notify_all()

    def _run(self, jobs: list[_Job]) -> None:
        self.num_calls += 1
        for use_decoder in (True, False):
            group = [job for job in jobs if job.use_decoder is use_decoder]
            if not group:
                continue
            wavs = decode_windows(self.audio, [w for job in group for w in job.windows], use_decoder)
            start = 0
            for job in group:
                job.wavs = wavs[start : start + len(job.windows)]
                start += len(job.windows)
