"""Torch CPU work on a thread of its own: ``on_own_thread``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


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
