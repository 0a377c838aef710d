"""Scatter of k/v rows into cache slots: one program per token copies all its heads."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._launch import num_warps_for


@triton.jit
def copy_heads(src_ptr, stride_head, dst_ptr, num_heads, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr):
    """Copy ``num_heads`` heads of HEAD_DIM values, ``stride_head`` apart at src, to contiguous heads at dst."""
    heads = tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    dims = tl.arange(0, HEAD_DIM)[None, :]  # [1, D]
    mask = heads < num_heads
    x = tl.load(src_ptr + heads * stride_head + dims, mask=mask)
    tl.store(dst_ptr + heads * HEAD_DIM + dims, x, mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_stride_tok, k_stride_head,
                     v_stride_tok, v_stride_head, num_heads, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        cache_off = slot * num_heads * HEAD_DIM
        copy_heads(k_ptr + tok * k_stride_tok, k_stride_head, k_cache_ptr + cache_off, num_heads, HEAD_DIM,
                    HEADS)
        copy_heads(v_ptr + tok * v_stride_tok, v_stride_head, v_cache_ptr + cache_off, num_heads, HEAD_DIM,
                    HEADS)


def store_kv_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    n, num_heads, head_dim = k.shape
    heads = triton.next_power_of_2(num_heads)
    _store_kv_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                           v.stride(1), num_heads, HEAD_DIM=head_dim, HEADS=heads,
                           num_warps=num_warps_for(heads * head_dim))
