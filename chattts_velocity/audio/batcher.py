"""``WindowBatcher``: the stream decode windows of every caller, decoded together. Each caller (a thread
streaming one ``infer`` call, a server request) hands its windows to ``decode`` and waits; whichever caller
finds the decoder free takes every window queued by then, from all callers, and runs them as one batched
Decoder + Vocos call per window length, then hands each caller its samples. Under load the windows of many
streams share one call (on a GPU a batch of 32 windows costs about what one does); alone, a caller decodes
at once. No extra thread: the waiting callers take turns leading."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from .decode import AudioDecoder
from .stream import Window, decode_windows


@dataclass(eq=False)
class _Job:
    windows: list[Window]
    use_decoder: bool
    wavs: list[np.ndarray] | None = None
    error: BaseException | None = None
    done: bool = field(default=False)


class WindowBatcher:
    def __init__(self, audio: AudioDecoder):
        self.audio = audio
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._busy = False
        self.num_calls = 0
        """Batched decode rounds run so far (a round is one ``decode_windows`` call per decoder kind)."""

    def decode(self, windows: list[Window], use_decoder: bool) -> list[np.ndarray]:
        """Each window's (2W - 1) * 256 samples, in order (``decode_windows``), batched with other callers'."""
        if not windows:
            return []
        job = _Job(windows, use_decoder)
        with self._cond:
            self._queue.append(job)
            while not job.done:
                if self._busy:
                    self._cond.wait()
                    continue
                self._busy = True
                batch, self._queue = self._queue, []
                self._cond.release()
                try:
                    self._run(batch)
                except BaseException as err:  # every caller of the round sees the failure
                    for other in batch:
                        other.error, other.done = err, True
                finally:
                    self._cond.acquire()
                    self._busy = False
                    self._cond.notify_all()
        if job.error is not None:
            raise job.error
        return job.wavs

    def _run(self, jobs: list[_Job]) -> None:
        self.num_calls += 1
        for use_decoder in (True, False):
            group = [job for job in jobs if job.use_decoder is use_decoder]
            if not group:
                continue
            wavs = decode_windows(self.audio, [w for job in group for w in job.windows], use_decoder)
            start = 0
            for job in group:
                job.wavs, job.done = wavs[start : start + len(job.windows)], True
                start += len(job.windows)
