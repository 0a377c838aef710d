"""Fused residual-add + RMSNorm: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import num_warps_for


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    offs = row * hidden + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add is rounded to x's dtype before the norm reads it, as the torch model does.
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + offs, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + offs, out.to(x.dtype), mask=mask)


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float,
                    residual: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
    n, hidden = x.shape
    out = torch.empty_like(x)
    new_res = out if residual is None else torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(n,)](x, x if residual is None else residual, weight, out, new_res, hidden, eps,
                           HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block))
    return out if residual is None else (out, new_res)
