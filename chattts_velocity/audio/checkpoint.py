"""Reading upstream ``.safetensors`` audio checkpoints, and the checks that turn a malformed one into a
``ValueError`` naming the file and the offending key (instead of a bare shape error deep inside torch)."""

from __future__ import annotations

import os
import re

from safetensors.torch import load_file
from torch import Tensor, nn


def load_checkpoint(path: str) -> dict[str, Tensor]:
    """All tensors of a safetensors file, on the CPU. Never unpickles (no ``torch.load``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    return load_file(path)


def require(sd: dict[str, Tensor], key: str, ndim: int, name: str) -> Tensor:
    """``sd[key]``, which must exist and have ``ndim`` dimensions."""
    if key not in sd:
        raise ValueError(f"{name}: missing key {key}")
    tensor = sd[key]
    if tensor.dim() != ndim:
        raise ValueError(f"{name}: {key} has shape {tuple(tensor.shape)}, expected {ndim} dimensions")
    return tensor


def count_layers(sd: dict[str, Tensor], prefix: str, name: str) -> int:
    """How many ``{prefix}.{i}.*`` sub-modules the state dict holds; the indices must run 0..n-1 without a gap."""
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    found = {int(m.group(1)) for key in sd if (m := pattern.match(key))}
    gaps = sorted(set(range(len(found))) - found)
    if gaps:
        raise ValueError(f"{name}: missing keys {prefix}.{gaps[0]}.* (found layers {sorted(found)})")
    return len(found)


def check_state_dict(module: nn.Module, sd: dict[str, Tensor], name: str) -> None:
    """Every key of ``module``'s state dict must be in ``sd`` with the same shape, and nothing else may be."""
    expected = module.state_dict()
    for key, tensor in expected.items():
        if key not in sd:
            raise ValueError(f"{name}: missing key {key}")
        if sd[key].shape != tensor.shape:
            raise ValueError(
                f"{name}: {key} has shape {tuple(sd[key].shape)}, expected {tuple(tensor.shape)}"
            )
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise ValueError(f"{name}: unexpected key {unexpected[0]} ({len(unexpected)} unexpected in all)")
