"""Safetensors reading and state-dict checks whose errors name the file and the tensor, instead of a bare shape
error deep inside torch. Never unpickles (no ``torch.load``)."""

from __future__ import annotations

import glob
import os
import re

import torch
from torch import Tensor, nn


def read_safetensors(path: str | os.PathLike) -> dict[str, Tensor]:
    """All tensors of one ``.safetensors`` file, on the CPU; a NaN or infinity in any of them is an error
    naming the file and the tensor (it would decode to NaN audio)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    try:
        sd = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    for key, tensor in sd.items():
        check_finite(tensor, key, str(path))
    return sd


def read_safetensors_dir(folder: str | os.PathLike) -> dict[str, Tensor]:
    """Every ``*.safetensors`` shard of a Hugging Face model folder, merged."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(read_safetensors(f))
    return out


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
    """Every key of ``module``'s state dict must be in ``sd`` with the same shape and kind of dtype (floating
    point or integer: loading would cast one to the other silently), and nothing else may be there."""
    expected = module.state_dict()
    for key, tensor in expected.items():
        if key not in sd:
            raise ValueError(f"{name}: missing key {key}")
        if sd[key].shape != tensor.shape:
            raise ValueError(f"{name}: {key} has shape {tuple(sd[key].shape)}, expected {tuple(tensor.shape)}")
        if sd[key].is_floating_point() != tensor.is_floating_point():
            kind = "a floating-point" if tensor.is_floating_point() else "an integer"
            raise ValueError(f"{name}: {key} has dtype {sd[key].dtype}, expected {kind} tensor: the file is not a "
                             "ChatTTS checkpoint or was converted wrongly")
    unexpected = sorted(set(sd) - set(expected))
    if unexpected:
        raise ValueError(f"{name}: unexpected key {unexpected[0]} ({len(unexpected)} unexpected in all)")


def check_finite(tensor: Tensor, key: str, name: str) -> None:
    """A floating-point ``tensor`` must hold no NaN or infinity (they would decode to NaN audio)."""
    if tensor.is_floating_point():
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise ValueError(f"{name}: {key} has {bad} NaN or infinite values of {tensor.numel()}: the file is "
                             "corrupt; download the checkpoint again")


def load_checked(module: nn.Module, sd: dict[str, Tensor], name: str) -> None:
    """``check_state_dict``, then a strict load (cast to the module's dtypes)."""
    check_state_dict(module, sd, name)
    expected = module.state_dict()
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in sd.items()}, strict=True)
