"""A speech server in a subprocess on 127.0.0.1 (a free port), over a tiny checkpoint, for the server tests."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``chattts-velocity serve`` as a child process; ``url`` once healthy."""

    def __init__(self, model_dir: str | None, *args: str, api_key: str | None = API_KEY, log_path: str | None = None,
                 env: dict | None = None, ready_timeout: float = 120, device: str = "cpu"):
        """``model_dir`` None: full-size random weights (``--dummy``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = ["--model", model_dir] if model_dir is not None else ["--dummy"]
        cmd = [sys.executable, "-m", "chattts_velocity.cli", "serve", *model, "--device", device,
               "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("CHATTTS_VELOCITY_API_KEY", None)
        self.log = open(log_path or os.devnull, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy(ready_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was healthy")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not become healthy in time")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def decode_audio(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Decoded mono samples and sample rate of a response body."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767, 24000
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        parts = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]  # mono
    return np.concatenate(parts).astype(np.float32), rate


def processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, command line)} of every process on this machine (Linux: read from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        found[int(entry)] = parent, cmdline
    return found


def spawned(parents: set[int], everything: dict[int, tuple[int, str]] | None = None) -> dict[int, int]:
    """{pid: parent} of the processes that ``multiprocessing`` spawned from ``parents`` (not its resource
    tracker)."""
    everything = processes() if everything is None else everything
    return {pid: parent for pid, (parent, cmd) in everything.items()
            if parent in parents and "spawn_main" in cmd and "resource_tracker" not in cmd}


def engine_processes(pid: int) -> list[int]:
    """The processes server process ``pid`` spawned: its engine process (``serve --engine-process``), and with
    ``--fronts`` its other HTTP fronts (``listening_pids`` tells them apart)."""
    return list(spawned({pid}))


def metric(url: str, name: str, headers: dict | None = None, default: float | None = None) -> float:
    """One sample of ``GET /metrics``: ``name`` with its labels as exposed (``x{a="1"}``), or bare; ``default``
    if the server has none (else ``KeyError``)."""
    for line in httpx.get(url + "/metrics", headers=headers, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise KeyError(name)
    return default


def _tcp_sockets(port: int | None) -> dict[int, tuple[str, int, int]]:
    """Socket inode -> (state, local port, peer port) of every TCP socket whose local port is ``port`` (None:
    any; IPv4 and IPv6)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            local_port = int(local.rsplit(":", 1)[1], 16)
            if port is None or local_port == port:
                found[inode] = ("listen" if state == "0A" else "open", local_port, int(remote.rsplit(":", 1)[1], 16))
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening_ports() -> dict[int, int]:
    """{socket inode: local port} of every listening TCP socket on this machine."""
    return {inode: local for inode, (state, local, _) in _tcp_sockets(None).items() if state == "listen"}


def listening_inodes(port: int | None = None) -> set[int]:
    """The inodes of the TCP sockets listening on ``port`` (None: on any port)."""
    return {inode for inode, (state, _, _) in _tcp_sockets(port).items() if state == "listen"}


def listening_pids(pids: list[int], port: int | None) -> list[int]:
    """Those of ``pids`` that listen on ``port`` (the fronts of ``serve --fronts``; None: on any port)."""
    listening = listening_inodes(port)
    return [pid for pid in pids if socket_inodes(pid) & listening]


def connection_owner(pids: list[int], port: int, client_port: int) -> int | None:
    """Which of ``pids`` holds the server end of the connection from ``client_port`` to ``port``."""
    inodes = {inode for inode, (state, _, peer) in _tcp_sockets(port).items()
              if state == "open" and peer == client_port}
    return next((pid for pid in pids if socket_inodes(pid) & inodes), None)


def stalled_reader(url: str, body: dict) -> socket.socket:
    """A client that sends a speech request (``body``) and never reads its response (a small receive buffer, so
    the server's sends soon wait for it). Close it when done."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock
