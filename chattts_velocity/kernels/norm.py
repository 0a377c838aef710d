"""RMSNorm with the residual add fused in front, as in Hugging Face ``LlamaRMSNorm``."""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import FLOAT_DTYPES, check, check_contiguous, check_same_device, check_tensor, use_triton


def rms_norm(x: Tensor, weight: Tensor, eps: float,
             residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """x [N, H] -> rmsnorm(x) * weight; with ``residual``: r = x + residual -> (rmsnorm(r) * weight, r).

    The norm runs in float32 and is cast to x's dtype before the weight multiply (Hugging Face's order);
    the new residual r stays in x's dtype.
    """
    _check(x, weight, residual)
    if use_triton(x):
        from ._triton.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float,
                 residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Torch reference of ``rms_norm`` (the CPU path)."""
    r = x if residual is None else x + residual  # [N, H]
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, r)


def _check(x: Tensor, weight: Tensor, residual: Tensor | None) -> None:
    check_tensor("x", x, "[N, H]", 2, FLOAT_DTYPES)
    check_contiguous("x", x)
    check_tensor("weight", weight, "[H]", 1, (x.dtype,))
    check(weight.shape[0] == x.shape[1],
          f"weight has {weight.shape[0]} elements, x has hidden size {x.shape[1]}")
    check_contiguous("weight", weight)
    if residual is None:
        check_same_device(x=x, weight=weight)
        return
    check_tensor("residual", residual, "[N, H]", 2, (x.dtype,))
    check(residual.shape == x.shape, f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    check_contiguous("residual", residual)
    check_same_device(x=x, weight=weight, residual=residual)
