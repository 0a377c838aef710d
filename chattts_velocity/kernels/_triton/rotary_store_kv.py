"""Rotary embedding and KV-cache write in one launch: one program per token loads its cos/sin once, rotates
all its q and k heads in place, then writes the rotated k (from registers) and v into its cache slot."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._launch import num_warps_for
from .kv_cache import copy_heads
from .rotary import head_halves, load_cos_sin, rotate_heads


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                            q_stride_tok, q_stride_head, k_stride_tok, k_stride_head, v_stride_tok,
                            v_stride_head, num_q_heads, num_k_heads, HALF: tl.constexpr,
                            Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(pos_ptr, tok, cos_sin_ptr, HALF)
    rotate_heads(q_ptr + tok * q_stride_tok, q_stride_head, num_q_heads, cos, sin, HALF, Q_HEADS)
    k1, k2 = rotate_heads(k_ptr + tok * k_stride_tok, k_stride_head, num_k_heads, cos, sin, HALF, K_HEADS)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        cache_off = slot * num_k_heads * (2 * HALF)
        ptrs, mask = head_halves(k_cache_ptr + cache_off, 2 * HALF, num_k_heads, HALF, K_HEADS)
        tl.store(ptrs, k1, mask=mask)
        tl.store(ptrs + HALF, k2, mask=mask)
        copy_heads(v_ptr + tok * v_stride_tok, v_stride_head, v_cache_ptr + cache_off, num_k_heads, 2 * HALF,
                    K_HEADS)


def rotary_store_kv_triton(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                           k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    n, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_heads, k_heads = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_k_heads)
    _rotary_store_kv_kernel[(n,)](q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                  num_q_heads, num_k_heads, HALF=head_dim // 2, Q_HEADS=q_heads,
                                  K_HEADS=k_heads, num_warps=num_warps_for(q_heads * head_dim))
