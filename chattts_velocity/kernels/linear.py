"""Linear layers of the decode step with their neighbours fused in: an optional residual add + RMSNorm in
front (the Llama layer's input and post-attention norms) and an optional SwiGLU gate behind (gate/up)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ._dispatch import FLOAT_DTYPES, check, check_contiguous, check_same_device, check_tensor, use_triton
from .activation import silu_and_mul_ref
from .norm import rms_norm_ref

MAX_FUSED_ROWS = 16
"""Up to this many rows one Triton program reads each weight tile once for all rows (a small decode batch).
Larger batches run the unfused ops: on an H100 the fused kernel beat them by 3.7-4.2 us per layer at 1 and 16
rows, and lost at 64 (qkv 11.1 vs 7.3 us, gate/up 18.1 vs 13.7 us)."""


def fused_linear(x: Tensor, weight: Tensor, *, norm_weight: Tensor | None = None, eps: float = 1e-6,
                 residual: Tensor | None = None, gated: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """x [M, K] -> y = h @ weight.T, where h = x, or with ``norm_weight`` h = rms_norm(r) * norm_weight with
    r = x (+ ``residual``). ``gated``: weight is cat(gate, up) [2I, K] and y = silu(h @ gate.T) * (h @ up.T)
    [M, I]. Returns y, or (y, r) when a residual is given. Every op rounds to x's dtype where the unfused
    ops do, so both agree up to float32 summation order."""
    _check(x, weight, norm_weight, residual, gated)
    if not use_triton(x):
        return _unfused(x, weight, norm_weight, eps, residual, gated, rms_norm_ref, silu_and_mul_ref)
    if x.shape[0] <= MAX_FUSED_ROWS:
        from ._triton.linear import fused_linear_triton

        return fused_linear_triton(x, weight, norm_weight, eps, residual, gated)
    # the unchecked kernels: _check covered their arguments (this runs in every layer)
    from ._triton.activation import silu_and_mul_triton
    from ._triton.norm import rms_norm_triton

    return _unfused(x, weight, norm_weight, eps, residual, gated, rms_norm_triton, silu_and_mul_triton)


def fused_linear_ref(x: Tensor, weight: Tensor, *, norm_weight: Tensor | None = None, eps: float = 1e-6,
                     residual: Tensor | None = None, gated: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Torch reference of ``fused_linear``: the unfused reference ops in turn."""
    _check(x, weight, norm_weight, residual, gated)
    return _unfused(x, weight, norm_weight, eps, residual, gated, rms_norm_ref, silu_and_mul_ref)


def _unfused(x: Tensor, weight: Tensor, norm_weight: Tensor | None, eps: float, residual: Tensor | None,
             gated: bool, norm: Callable, gate: Callable) -> Tensor | tuple[Tensor, Tensor]:
    h, r = x, None
    if norm_weight is not None:
        h = norm(x, norm_weight, eps, residual)
        if residual is not None:
            h, r = h
    y = h @ weight.T  # [M, N]
    if gated:
        y = gate(y)
    return y if r is None else (y, r)


def _check(x: Tensor, weight: Tensor, norm_weight: Tensor | None, residual: Tensor | None, gated: bool) -> None:
    check_tensor("x", x, "[M, K]", 2, FLOAT_DTYPES)
    check_contiguous("x", x)
    check_tensor("weight", weight, "[N, K]", 2, (x.dtype,))
    check_contiguous("weight", weight)
    check(weight.shape[1] == x.shape[1], f"weight has {weight.shape[1]} inputs, x has {x.shape[1]} features")
    check(not gated or weight.shape[0] % 2 == 0,
          f"a gated weight stacks gate and up rows, got an odd row count {weight.shape[0]}")
    check(residual is None or norm_weight is not None, "a residual is only added in front of a norm")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, "[K]", 1, (x.dtype,))
        check(norm_weight.shape[0] == x.shape[1],
              f"norm_weight has {norm_weight.shape[0]} elements, x has {x.shape[1]} features")
        check_contiguous("norm_weight", norm_weight)
    if residual is not None:
        check_tensor("residual", residual, "[M, K]", 2, (x.dtype,))
        check(residual.shape == x.shape, f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        check_contiguous("residual", residual)
    optional = {"norm_weight": norm_weight, "residual": residual}
    check_same_device(x=x, weight=weight, **{k: v for k, v in optional.items() if v is not None})
