"""Where each op runs, and the argument checks its launcher makes before running it."""

from __future__ import annotations

import os

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def use_triton(t: Tensor) -> bool:
    """Triton for CUDA tensors, and for CPU tensors under ``TRITON_INTERPRET=1`` (the Triton interpreter)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_tensor(name: str, t: Tensor, shape: str, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """``t`` has ``ndim`` dims (``shape`` names them in the message) and one of ``dtypes``."""
    # messages are built only on failure: these checks run for every op of every CPU decode step
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {shape}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype {names}, got {t.dtype}")


def check_rows(name: str, t: Tensor) -> None:
    """Kernels walk rows with any stride but need each row's last dim contiguous."""
    check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim (got strides {t.stride()}); "
                             "call .contiguous() first")


def check_contiguous(name: str, t: Tensor) -> None:
    check(t.is_contiguous(), f"{name} must be contiguous; call .contiguous() first")


def check_same_device(**tensors: Tensor) -> None:
    first = next(iter(tensors.values())).device
    if any(t.device != first for t in tensors.values()):
        devices = {name: t.device for name, t in tensors.items()}
        raise ValueError(f"tensors must share one device, got {devices}")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
