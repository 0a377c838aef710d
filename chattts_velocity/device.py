"""Which torch device the model runs on: the default, and a clear error for one that does not exist here."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from .kernels.linear import cpu_weight_formats

T = TypeVar("T")


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


def on_own_thread(device: torch.device, fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a thread of its own on the CPU (where it returns or raises as if called here),
    directly elsewhere. Why: torch's CPU ops share out their work through OpenMP, which keeps a team of worker
    threads for each thread that ran a parallel op, until that thread ends. Once the caller holds a team (from
    loading a model, or decoding its wavs) and the engine's thread holds another, more threads wait on the cores
    than there are cores, and OpenMP stops its workers spinning between ops: each of the engine's ops then waits
    for them to wake, and a batch-1 step took far longer (`chattts-velocity bench --device cpu` steps on the
    caller's thread; ``Chat.infer`` on the engine's; docs/perf/cpu.md). Work done on a thread of its own leaves
    no team behind."""
    if device.type != "cpu":
        return fn(*args, **kwargs)
    box: dict[str, object] = {}
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()  # (thread-local: carried over)

    def run() -> None:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                box["result"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = err

    worker = threading.Thread(target=run, name="chattts-velocity-cpu-work", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
