"""``CommandWriter``: a front's commands down its pipe to the engine process without ever blocking the caller.

A blocking ``Connection.send`` waits while the pipe is full, and the pipe fills when the engine process stops
reading (hung, or stopped with SIGSTOP): the front's event loop would wait with it, and ``/health`` with it. Here
a message is written at once with a non-blocking write when the pipe has room (no thread hop on the request
path), and whatever does not fit waits in a backlog that a thread of its own writes as the pipe drains. The
bytes are framed as ``multiprocessing.connection.Connection`` frames them, so the engine process reads them
with ``recv``."""

from __future__ import annotations

import os
import select
import struct
import threading
from multiprocessing.reduction import ForkingPickler


class PipeClosedError(OSError):
    """The engine process's end of the pipe is closed (it exited)."""


def frame(msg) -> bytes:
    """``msg`` pickled behind the length header ``Connection.recv`` reads."""
    payload = bytes(ForkingPickler.dumps(msg))
    n = len(payload)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!i", -1) + struct.pack("!Q", n)
    return header + payload


class CommandWriter:
    """Writes framed messages to the pipe ``conn`` (a ``Connection`` this object now owns for writing; its
    descriptor is made non-blocking). ``send`` never blocks on the pipe; ``backlog`` is what waits."""

    def __init__(self, conn):
        self.conn = conn
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._lock = threading.Lock()  # guards the backlog and every write
        self._backlog = bytearray()
        self._wake = threading.Condition(self._lock)
        self._closed: str | None = None
        self._thread: threading.Thread | None = None

    @property
    def backlog(self) -> int:
        """Bytes written by ``send`` that the pipe has not taken yet."""
        return len(self._backlog)

    def send(self, msg) -> None:
        """Write ``msg`` (or queue what the pipe cannot take now); ``PipeClosedError`` once the pipe closed."""
        data = frame(msg)
        with self._lock:
            if self._closed is not None:
                raise PipeClosedError(self._closed)
            if not self._backlog:
                data = data[self._write(data):]
            if data:
                self._backlog += data
                self._start_flusher()
                self._wake.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = self._closed or "closed"
            self._wake.notify()
        self.conn.close()

    def _write(self, data) -> int:
        """Bytes of ``data`` the pipe took now (0 if full); marks the writer closed if the pipe is."""
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError as e:  # EPIPE: the engine process is gone; EBADF: closed here
            self._closed = f"the engine process's pipe is closed ({e.strerror})"
            raise PipeClosedError(self._closed) from None

    def _start_flusher(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._flush, name="chattts-velocity-engine-send", daemon=True)
            self._thread.start()

    def _flush(self) -> None:
        """Write the backlog as the pipe drains, until the writer closes."""
        while True:
            with self._lock:
                while not self._backlog and self._closed is None:
                    self._wake.wait()
                if self._closed is not None:
                    return
            try:
                select.select([], [self._fd], [], 1.0)
            except (OSError, ValueError):  # closed meanwhile
                return
            with self._lock:
                if self._closed is not None or not self._backlog:
                    continue
                try:
                    del self._backlog[:self._write(self._backlog)]
                except PipeClosedError:
                    self._backlog.clear()
                    return
