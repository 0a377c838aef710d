"""Paged varlen prefill attention, flash-attention style: a program per (query tile, q head) walks KV tiles.

The grid is flat over the query tiles of all sequences, so no host-side max q_len is needed (no GPU sync):
sequence s owns the tiles from cu_seqlens_q[s] // BLOCK_M + s on, which leaves room for its
ceil(q_len / BLOCK_M) tiles, and a program finds its sequence by binary search. KV tiles wholly left of the
tile's first query need no causal mask; only the few along the diagonal do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .paged import kv_offsets

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(cu_seqlens_ptr, num_seqs, tile, BLOCK_M: tl.constexpr):
    """The last sequence s whose first tile, cu_seqlens[s] // BLOCK_M + s, is <= ``tile``."""
    lo = tl.zeros([], tl.int32)
    hi = num_seqs + lo  # the answer is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, kv_tile, kv_end, bt_row, k_cache_ptr, v_cache_ptr, kv_head_offset,
                 row_stride, qk_scale, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of a query tile over the KV tokens kv_tile .. kv_tile + BLOCK_N."""
    tokens = kv_tile + tl.arange(0, BLOCK_N)
    valid = tokens < kv_end
    offs = kv_offsets(bt_row, tokens, valid, kv_head_offset, row_stride, BLOCK_SIZE)
    dims = tl.arange(0, HEAD_DIM)
    k_t = tl.load(k_cache_ptr + offs[None, :] + dims[:, None], mask=valid[None, :], other=0.0)  # [D, BLOCK_N]
    scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if CAUSAL:
        scores = tl.where(tokens[None, :] <= q_pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


# Not specialised on the sequence count and the block table's width: Triton compiles a variant per value class
# of an int argument (1, a multiple of 16, other), and these vary with the batch, so under `serve` a burst of
# requests compiled new variants mid-step (with an empty Triton cache), each a step of over a second; neither
# feeds vectorised loads.
@triton.jit(do_not_specialize=["num_seqs", "bt_stride"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr,
                    out_ptr, qk_scale, num_seqs, q_stride_tok, q_stride_head, bt_stride, num_kv_heads, group,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    seq = _find_seq(cu_seqlens_ptr, num_seqs, tile, BLOCK_M)
    q_begin = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_begin
    m_start = (tile - (q_begin // BLOCK_M + seq)) * BLOCK_M
    if m_start < q_len:
        prefix = tl.load(context_lens_ptr + seq) - q_len  # tokens cached before this step's queries
        rows = m_start + tl.arange(0, BLOCK_M)
        row_valid = rows < q_len
        dims = tl.arange(0, HEAD_DIM)
        tok = (q_begin + rows).to(tl.int64)[:, None]  # [BLOCK_M, 1]
        q_offs = tok * q_stride_tok + head * q_stride_head + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, D]
        q_pos = prefix + rows  # [BLOCK_M]
        bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride
        kv_head_offset = (head // group) * HEAD_DIM
        row_stride = num_kv_heads * HEAD_DIM
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # Tiles wholly at or before the first query's position are visible to every row (and hold only valid
        # tokens); token 0 is in the first tile processed, so every row's running max is finite after it.
        full_end = (prefix + m_start + 1) // BLOCK_N * BLOCK_N
        kv_end = prefix + tl.minimum(m_start + BLOCK_M, q_len)
        for kv_tile in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, kv_tile, kv_end, bt_row, k_cache_ptr,
                                         v_cache_ptr, kv_head_offset, row_stride, qk_scale, BLOCK_SIZE,
                                         HEAD_DIM, BLOCK_N, False, DOT_PRECISION)
        for kv_tile in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, kv_tile, kv_end, bt_row, k_cache_ptr,
                                         v_cache_ptr, kv_head_offset, row_stride, qk_scale, BLOCK_SIZE,
                                         HEAD_DIM, BLOCK_N, True, DOT_PRECISION)
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        out_offs = tok * (tl.num_programs(1) * HEAD_DIM) + head * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + out_offs, out, mask=row_valid[:, None])


def paged_prefill_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                   cu_seqlens_q: Tensor, context_lens: Tensor, scale: float) -> Tensor:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a view
    if num_seqs == 0:
        return out
    block_m, block_n, stages = _tiles(q)
    # float32 stays exact (no tf32 rounding), keeping the float32 engine's parity with the torch model.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (num_tokens // block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), block_tables.stride(0), num_kv_heads, num_heads // num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=precision,
        num_warps=4, num_stages=stages)
    return out


def _tiles(q: Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, pipeline stages). float32's exact (FMA) dot needs small tiles and 2 stages: ptxas
    spills registers for a third stage or 64-wide tiles at the model's head size. The interpreter runs small
    tiles so tiny test shapes still cross several of them."""
    if not q.is_cuda:
        return 16, 16, 1
    return (32, 32, 2) if q.dtype == torch.float32 else (64, 64, 3)
