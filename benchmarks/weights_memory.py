"""Weights held once: load the full-size model (random weights) on the CPU in float32 and report the process's
resident memory and the distinct bytes behind the engine core's weights and the transformers layers' weights
(the reference path's), which share storage where dtype and device agree.

    python benchmarks/weights_memory.py
"""

from __future__ import annotations

import gc
import resource

from chattts_velocity import Chat


def distinct_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def resident_mib() -> float:
    """The process's resident memory now (Linux), else its peak."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    chat = Chat()
    chat.load(load_format="dummy", device="cpu", num_kv_blocks=16)
    gc.collect()
    core = chat.engine.engine.worker.core
    core_tensors = [t for layer in core.layers for t in vars(layer).values()] + [core.norm]
    hf_tensors = list(chat.model.gpt.llama.parameters())
    mib = 2**20
    print(f"resident {resident_mib():.0f} MiB; engine core "
          f"{distinct_bytes(core_tensors) / mib:.0f} MiB, transformers layers {distinct_bytes(hf_tensors) / mib:.0f} "
          f"MiB, both together {distinct_bytes(core_tensors + hf_tensors) / mib:.0f} MiB")


if __name__ == "__main__":
    main()
