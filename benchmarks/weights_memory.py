"""Weights held once: load the full-size model (random weights) on the CPU and report the process's resident
memory and the distinct bytes behind the engine core's weights and the transformers layers' weights (the
reference path's). They share storage where dtype and device agree (the engine in float32 on the CPU); where
they cannot (``--engine-dtype float16``, as on a GPU), the transformers weights are let go after the load and
read again on the reference path's first use.

    python benchmarks/weights_memory.py
    python benchmarks/weights_memory.py --engine-dtype float16
    python benchmarks/weights_memory.py --device cuda --engine-dtype float16   (GPU memory allocated by torch)
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

import torch

from chattts_velocity import Chat
from chattts_velocity.engine.engine_config import ENGINE_DTYPES
from chattts_velocity.kernels.linear import CpuWeight


def distinct_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``; a ``CpuWeight`` (a CPU engine dtype's packed matrix) counts
    its matrix and scales."""
    storages = {}
    for t in tensors:
        for part in (t.data, t.scale) if isinstance(t, CpuWeight) else (t,):
            if part is not None:
                storages[part.untyped_storage().data_ptr()] = part.untyped_storage().nbytes()
    return sum(storages.values())


def resident_mib() -> float:
    """The process's resident memory now (Linux), else its peak."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-dtype", default="float32", choices=ENGINE_DTYPES)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    chat = Chat()
    chat.load(load_format="dummy", device=args.device, num_kv_blocks=16, engine_dtype=args.engine_dtype)
    gc.collect()
    cuda = torch.device(args.device).type == "cuda"

    def gpu_mib() -> str:
        return f"; GPU memory allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB" if cuda else ""

    core = chat.engine.engine.runner.core
    core_tensors = [t for layer in core.layers for t in vars(layer).values()] + [core.norm]
    hf_tensors = list(chat.model.gpt.llama.parameters())
    mib = 2**20
    print(f"engine {args.engine_dtype}: resident {resident_mib():.0f} MiB; engine core "
          f"{distinct_bytes(core_tensors) / mib:.0f} MiB, transformers layers {distinct_bytes(hf_tensors) / mib:.0f} "
          f"MiB, both together {distinct_bytes(core_tensors + hf_tensors) / mib:.0f} MiB{gpu_mib()}")
    if chat.model.gpt.llama_released:
        start = time.perf_counter()
        chat.model.gpt.ensure_llama()  # what the first use_velocity=False call does
        gc.collect()
        print(f"  the reference weights read again in {time.perf_counter() - start:.1f} s: resident "
              f"{resident_mib():.0f} MiB, transformers layers "
              f"{distinct_bytes(chat.model.gpt.llama.parameters()) / mib:.0f} MiB{gpu_mib()}")


if __name__ == "__main__":
    main()
