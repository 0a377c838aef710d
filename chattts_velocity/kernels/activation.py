"""SwiGLU gate: silu(gate) * up on the fused gate/up projection."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ._dispatch import FLOAT_DTYPES, check, check_contiguous, check_tensor, use_triton


def silu_and_mul(x: Tensor) -> Tensor:
    """x [N, 2I] = cat(gate, up) -> silu(gate) * up [N, I], in float32, rounded once to x's dtype."""
    check_tensor("x", x, "[N, 2I]", 2, FLOAT_DTYPES)
    check(x.shape[1] % 2 == 0, f"x must hold gate and up halves, got an odd last dim {x.shape[1]}")
    check_contiguous("x", x)
    if use_triton(x):
        from ._triton.activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def silu_and_mul_ref(x: Tensor) -> Tensor:
    """Torch reference of ``silu_and_mul`` (the CPU path)."""
    gate, up = x.float().chunk(2, dim=-1)  # [N, I] each
    return (F.silu(gate) * up).to(x.dtype)
