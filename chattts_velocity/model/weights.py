"""Safetensors reading with errors that name the file and the tensor (never unpickles anything)."""

from __future__ import annotations

import glob
import os

import torch
from torch import nn


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of one ``.safetensors`` file (CPU)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing checkpoint file: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None


def read_safetensors_dir(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every ``*.safetensors`` shard of a Hugging Face model folder, merged."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(read_safetensors(f))
    return out


def load_checked(module: nn.Module, state: dict[str, torch.Tensor], name: str) -> None:
    """``load_state_dict`` that first reports missing, unexpected and wrong-shaped tensors by name."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{name}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}"
                         f" ({len(missing)} missing, {len(unexpected)} unexpected)")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise ValueError(f"{name}: tensor {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
