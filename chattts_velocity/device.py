"""Which torch device the model runs on: the default, and a clear error for one that does not exist here."""

from __future__ import annotations

import threading
import time

import torch

from .kernels.linear import cpu_weight_formats


def available_devices() -> list[str]:
    """The devices this machine can run the model on."""
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return ["cpu", *cuda]


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` that exists here (None: cuda if available, else cpu); ``ValueError``
    listing the devices that do exist."""
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    here = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {device!r}: devices here are {here}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine (no GPU, or a CPU-only torch); "
                         f"devices here are {here}")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} does not exist: devices here are {here}")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the model runs on cpu or cuda; devices here are {here}")
    return dev


def default_engine_dtype(device: torch.device | str | None) -> str:
    """The engine dtype the serving entry points (``serve``, ``webui``, ``synth``, ``bench``, a Ray replica) use
    unless told otherwise: float16, the fast path on both. On CUDA the whole core computes in float16; on the
    CPU only the matrices are stored in float16 and multiplied in float32 (fbgemm), which follows the float32
    engine closely (`chattts-velocity bench agreement`, docs/perf/cpu.md); float32 where fbgemm does not run
    (a non-x86 CPU). ``Chat.load`` keeps float32 as its own default, as upstream's Python API computes."""
    if resolve_device(device).type == "cuda" or "float16" in cpu_weight_formats():
        return "float16"
    return "float32"


_waits = threading.local()


def wait_for(work) -> None:
    """``work.synchronize()`` (a CUDA event or stream), its duration added to this thread's ``device_wait_s``."""
    start = time.perf_counter()
    work.synchronize()
    _waits.seconds = device_wait_s() + time.perf_counter() - start


def device_wait_s() -> float:
    """Seconds this thread has spent waiting for the device in ``wait_for``: a thread's time apart from its
    host work (``AsyncLLMEngine``'s part of ``EngineStats.thread_time``)."""
    return getattr(_waits, "seconds", 0.0)
