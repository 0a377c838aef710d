"""silu(gate) * up: programs over (row, column block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import num_warps_for

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: Tensor) -> Tensor:
    n, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), _MAX_BLOCK)
    grid = (n, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x, out, inter, BLOCK=block, num_warps=num_warps_for(block))
    return out
