"""Rotary embedding in place: one program per token rotates all its q and k heads with one cos/sin load."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._launch import num_warps_for


@triton.jit
def load_cos_sin(pos_ptr, tok, cache_ptr, HALF: tl.constexpr):
    """cos and sin [1, D/2] of token ``tok``'s position."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * (2 * HALF) + cols)[None, :]
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + cols)[None, :]
    return cos, sin


@triton.jit
def head_halves(x_ptr, stride_head, num_heads, HALF: tl.constexpr, HEADS: tl.constexpr):
    """Pointers [HEADS, D/2] to the first half of each head (the second half is HALF further), live-head mask."""
    heads = tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    return x_ptr + heads * stride_head + tl.arange(0, HALF)[None, :], heads < num_heads


@triton.jit
def rotate_heads(x_ptr, stride_head, num_heads, cos, sin, HALF: tl.constexpr, HEADS: tl.constexpr):
    """Rotate the heads at x_ptr in place; returns the rotated halves, each [HEADS, D/2] in x's dtype."""
    ptrs, mask = head_halves(x_ptr, stride_head, num_heads, HALF, HEADS)
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(ptrs, y1, mask=mask)
    tl.store(ptrs + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, q_stride_tok, q_stride_head, k_stride_tok, k_stride_head,
                   num_q_heads, num_k_heads, HALF: tl.constexpr, Q_HEADS: tl.constexpr,
                   K_HEADS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(pos_ptr, tok, cache_ptr, HALF)
    rotate_heads(q_ptr + tok * q_stride_tok, q_stride_head, num_q_heads, cos, sin, HALF, Q_HEADS)
    rotate_heads(k_ptr + tok * k_stride_tok, k_stride_head, num_k_heads, cos, sin, HALF, K_HEADS)


def apply_rotary_triton(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> None:
    n, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_heads, k_heads = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_k_heads)
    _rotary_kernel[(n,)](q, k, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         num_q_heads, num_k_heads, HALF=head_dim // 2, Q_HEADS=q_heads, K_HEADS=k_heads,
                         num_warps=num_warps_for(q_heads * head_dim))
