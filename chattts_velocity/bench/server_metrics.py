"""What ``bench serve`` reads of the server around a level or a rate (``Readings``): off its ``/metrics`` page the
engine thread's time by part, its prompt steps and decode windows and its own means on the way to first audio,
and, for a server on this machine, the GPUs' utilization; together they say whether the server was bound by its
GPU or by its host, and where its first audio's time went."""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
import urllib.request
from urllib.parse import urlsplit

THREAD_METRIC = "chattts_engine_thread_seconds"
"""The engine thread's time by part (``timings.THREAD_PARTS``), a counter on the server's ``/metrics``."""
STEP_COUNTERS = {"prompt_steps": "chattts_engine_prompt_steps", "windows": "chattts_engine_windows",
                 "window_steps": "chattts_engine_window_steps", "window_tokens": "chattts_engine_window_tokens"}
"""The engine's step counters on ``/metrics`` (``EngineStats.num_prompt_steps`` ...)."""


def metrics_page(url: str) -> str | None:
    """The server's ``/metrics`` page; None when it cannot be read."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as page:
            return page.read().decode()
    except (OSError, ValueError):
        return None


def _counter(text: str | None, name: str) -> list[tuple[str, float]]:
    """Every series of counter ``name`` on a ``/metrics`` page: (its labels as written, its value)."""
    return [(labels, float(value)) for labels, value in
            re.findall(rf"^{name}_total(?:{{([^}}]*)}})? (\S+)$", text or "", re.MULTILINE)]


def thread_seconds(text: str | None) -> dict[str, float] | None:
    """The engine thread's seconds by part (``THREAD_METRIC``) on a ``/metrics`` page, summed over its series
    (replicas); None without the page or the family (a server before it)."""
    seconds: dict[str, float] = {}
    for labels, value in _counter(text, THREAD_METRIC):
        if part := re.search(r'part="(\w+)"', labels):
            seconds[part.group(1)] = seconds.get(part.group(1), 0.0) + value
    return seconds or None


def thread_shares(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """``engine_thread``: each part's share of the engine thread's time between two ``thread_seconds``."""
    if before is None or after is None:
        return None
    spent = {part: after[part] - before.get(part, 0.0) for part in after}
    total = sum(spent.values())
    return {part: seconds / total for part, seconds in spent.items()} if total > 0 else None


def format_shares(shares: dict[str, float]) -> str:
    """``engine_thread`` as one line: each part's percentage, a part's device waits beside it."""
    cells = []
    for part in ("idle", "step", "deliver"):
        wait = shares.get(part + "_device_wait")
        cells.append(f"{part} {100 * shares.get(part, 0.0):.0f}%" + ("" if wait is None else
                                                                     f" + device wait {100 * wait:.0f}%"))
    return ", ".join(cells)


def engine_counts(text: str | None) -> dict[str, float] | None:
    """``STEP_COUNTERS`` on a ``/metrics`` page, each summed over its series (replicas); None without the page
    or the counters (a server before them)."""
    counts = {key: _counter(text, name) for key, name in STEP_COUNTERS.items()}
    if not all(counts.values()):
        return None
    return {key: sum(value for _, value in series) for key, series in counts.items()}


def windows_between(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """``engine_steps``: the engine's prompt steps and decode windows between two ``engine_counts``, with the
    mean window (steps) and the mean decode batch (sequences)."""
    if before is None or after is None:
        return None
    d = {key: after[key] - before[key] for key in STEP_COUNTERS}
    return {"prompt_steps": int(d["prompt_steps"]), "windows": int(d["windows"]),
            "mean_window_steps": d["window_steps"] / d["windows"] if d["windows"] else None,
            "mean_batch": d["window_tokens"] / d["window_steps"] if d["window_steps"] else None}


def format_windows(steps: dict) -> str:
    """``engine_steps`` as words."""
    if not steps["windows"]:
        return f"{steps['prompt_steps']} prompt steps, no decode window"
    return (f"{steps['windows']} decode windows of {steps['mean_window_steps']:.1f} steps at a batch of "
            f"{steps['mean_batch']:.1f}, {steps['prompt_steps']} prompt steps")


SERVER_MEANS = {"to_first_token": "chattts_engine_first_token_seconds",
                "to_first_audio": "chattts_engine_first_audio_seconds",
                "first_decode": "chattts_engine_first_decode_seconds",
                "first_audio": "chattts_time_to_first_audio_seconds"}
"""``server_mean_ms``'s histograms on the server's ``/metrics``: submitted to the engine → first token, from there
→ first audio, the audio pump's part of that, and the HTTP request's start → first audio at the front."""

MEANS_LEGEND = "to first token, then to first audio (the audio pump's part); first audio at the front"
"""What ``format_means`` writes, in order."""


def page_sums(text: str | None) -> dict[str, tuple[float, float]] | None:
    """Each of ``SERVER_MEANS``' histograms on a ``/metrics`` page: (sum, count) over its series (fronts and
    replicas); None without the page (it could not be read)."""
    if text is None:
        return None
    sums = {}
    for name in SERVER_MEANS.values():
        values = {"sum": 0.0, "count": 0.0}
        for part, value in re.findall(rf"^{name}_(sum|count)(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE):
            values[part] += float(value)
        sums[name] = (values["sum"], values["count"])
    return sums


def server_means(before, after) -> dict[str, float | None] | None:
    """``server_mean_ms`` between two ``page_sums``: each histogram's mean (ms) over what it observed between
    them (None where it observed nothing, or the server lacks it); None without both."""
    if before is None or after is None:
        return None
    means = {}
    for key, name in SERVER_MEANS.items():
        total, count = (a - b for a, b in zip(after.get(name, (0.0, 0.0)), before.get(name, (0.0, 0.0)),
                                               strict=True))
        means[key] = total / count * 1e3 if count > 0 else None
    return means


def cell(value, fmt: str = ".1f") -> str:
    """A figure of a printed table or line, "-" for None (not measured)."""
    return "-" if value is None else format(value, fmt)


def format_means(means: dict) -> str:
    """``server_mean_ms`` as ``MEANS_LEGEND`` says."""
    to_token, to_audio, decode, front = (cell(means.get(key)) for key in SERVER_MEANS)
    return f"{to_token}, {to_audio} ({decode}); {front}"


class GpuBusy:
    """This machine's GPU utilization while a level runs, from ``nvidia-smi`` (the share of time a kernel ran,
    sampled every ``period_ms``, averaged over the GPUs and the samples): for a server on this machine, whether
    its GPU or its host was the bottleneck. Samples only where ``url`` is this machine's (a loopback address)
    and ``nvidia-smi`` is on the path; ``mean`` (0-1) is None otherwise, or without a sample."""

    def __init__(self, url: str, period_ms: int = 100):
        self.period_ms, self.mean, self.samples = period_ms, None, 0
        self._on = _loopback(url) and shutil.which("nvidia-smi") is not None
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> GpuBusy:
        if self._on:
            try:
                self._proc = subprocess.Popen(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                     "-lms", str(self.period_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        values = [int(line) for line in out.split() if line.strip().isdigit()]
        self.samples = len(values)
        self.mean = sum(values) / len(values) / 100 if values else None


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def format_engine(row: dict) -> str:
    """A level's or a rate's ``gpu_busy``, ``engine_thread`` and ``engine_steps`` as one line ("" without any)."""
    parts = []
    if row.get("gpu_busy") is not None:
        parts.append(f"GPU busy {100 * row['gpu_busy']:.0f}%")
    if row.get("engine_thread"):
        parts.append(f"engine thread {format_shares(row['engine_thread'])}")
    if row.get("engine_steps"):
        parts.append(format_windows(row["engine_steps"]))
    return "; ".join(parts)


class Readings:
    """The server over the block it wraps, from ``start`` (which the block calls once its clients are ready and
    about to send: the clients' own start, when the server idles, is left out) to the block's end: its
    ``/metrics`` page then and at the end (``before``, ``after``; None where it cannot be read, or without a
    ``start``) and ``GpuBusy`` between; ``fields()`` is a row's ``engine_thread``, ``engine_steps``,
    ``server_mean_ms`` and ``gpu_busy``."""

    def __init__(self, url: str):
        self.url, self.before, self.after = url, None, None
        self._gpu: GpuBusy | None = None

    def __enter__(self) -> Readings:
        return self

    def start(self) -> None:
        """The timed part begins now: the page before it, and the GPU's samples from here."""
        self.before = metrics_page(self.url)
        self._gpu = GpuBusy(self.url).__enter__()

    def __exit__(self, *exc) -> None:
        if self._gpu is None:
            return
        self._gpu.__exit__(*exc)
        self.after = metrics_page(self.url)

    def fields(self) -> dict:
        return {"engine_thread": thread_shares(thread_seconds(self.before), thread_seconds(self.after)),
                "engine_steps": windows_between(engine_counts(self.before), engine_counts(self.after)),
                "server_mean_ms": server_means(page_sums(self.before), page_sums(self.after)),
                "gpu_busy": None if self._gpu is None else self._gpu.mean}

