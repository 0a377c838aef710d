"""One matrix for several modules' weights, which the modules' own weights become views of, so each weight is
held once: the engine's fused q/k/v and gate/up matrices, and the CPU decode's single code-embedding table."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def stacked_weights(modules: list[nn.Module], dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> Tensor:
    """The modules' ``weight`` rows stacked into one [sum N_i, K] matrix (in ``dtype`` on ``device``; default:
    the weights' own). Where that is the weights' own dtype and device, each module's weight becomes a view of
    its rows (the old tensor is dropped), so the engine's stacked weights cost no second copy."""
    first = modules[0].weight
    # ordinary tensors even when called under inference mode: the modules' weights become views of this one,
    # and an inference tensor there breaks the model once it is moved or cast (then used outside that mode)
    with torch.inference_mode(False), torch.no_grad():
        stacked = torch.cat([m.weight.detach() for m in modules]).to(device=device or first.device,
                                                                     dtype=dtype or first.dtype).contiguous()
    if all(m.weight.dtype == stacked.dtype and m.weight.device == stacked.device for m in modules):
        row = 0
        for m in modules:
            n = m.weight.shape[0]
            m.weight = nn.Parameter(stacked[row : row + n], requires_grad=m.weight.requires_grad)
            row += n
    return stacked
