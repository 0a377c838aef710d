"""Paged decode attention: one program per (sequence, q head, context split), online softmax over KV tiles.

With several splits (flash-decoding) each program leaves an unnormalised partial result with its running max
and sum, and a second kernel merges the splits. A batch with fewer (sequence, head) pairs than SMs needs that
to use the whole GPU: batch 1 alone keeps only as many SMs busy as the model has heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import linear
from ._launch import pdl_launch, sm_count
from .paged import kv_offsets

_LOG2E = 1.4426950408889634
# Fewer (sequence, head) pairs than this many per SM get flash-decoding splits of one tile each (in large batches
# splitting only added time). Up to _LONG_SPLIT_ROWS sequences a split's tile is _SPLIT_TOKENS tokens on four
# warps: at 1 to 8 sequences and contexts of 100 to 1,000 tokens it beat 64-token splits in all but the shorter
# contexts of 2 sequences, and wide unsplit tiles at the longer contexts; more sequences keep 64-token splits
# (`benchmarks/kernel_probe.py --parts attention_splits`; docs/perf/).
_PROGRAMS_PER_SM = 2
_SPLIT_TOKENS = 256
_LONG_SPLIT_ROWS = 8


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, max_ptr,
                   sum_ptr, qk_scale, q_stride_seq, q_stride_head, bt_stride, split_len, num_kv_heads, group,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched early (programmatic dependent launch): start the next kernel, wait for the last one
        gdc_launch_dependents()
        gdc_wait()
    seq, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = seq * tl.num_programs(1) + head  # index of (seq, head) in out
    start = split * split_len
    end = tl.minimum(start + split_len, tl.load(context_lens_ptr + seq))
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * q_stride_seq + head * q_stride_head + dims).to(tl.float32)
    q = q * qk_scale  # [D]; scores come out in log2 units for exp2
    bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride
    kv_head_offset = (head // group) * HEAD_DIM
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    # Every tile starts below `end`, so it holds a valid token and m_i is finite after the first one.
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        valid = tokens < end
        offs = kv_offsets(bt_row, tokens, valid, kv_head_offset, num_kv_heads * HEAD_DIM, BLOCK_SIZE)
        offs = offs[:, None] + dims[None, :]  # [BLOCK_N, D]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1), float("-inf"))  # [BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    if SPLIT:
        part = row * tl.num_programs(2) + split
        tl.store(max_ptr + part, m_i)
        tl.store(sum_ptr + part, l_i)
        tl.store(out_ptr + part.to(tl.int64) * HEAD_DIM + dims, acc)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)  # an empty context gives zeros, not NaN
        tl.store(out_ptr + row.to(tl.int64) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_splits_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, context_lens_ptr, num_splits, num_heads, split_len,
                         HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS)
    # only the splits that hold context tokens: the rest of the grid sized for the table width was empty
    live = tl.cdiv(tl.load(context_lens_ptr + row // num_heads), split_len)
    valid = splits < tl.minimum(live, num_splits)
    maxes = tl.load(max_ptr + row * num_splits + splits, mask=valid, other=float("-inf"))  # [SPLITS]
    sums = tl.load(sum_ptr + row * num_splits + splits, mask=valid, other=0.0)
    top = tl.max(maxes, axis=0)
    weights = tl.exp2(maxes - tl.where(top == float("-inf"), 0.0, top))  # empty splits (max -inf) weigh 0
    dims = tl.arange(0, HEAD_DIM)
    offs = (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :]  # [SPLITS, D]
    acc = tl.sum(tl.load(acc_ptr + offs, mask=valid[:, None], other=0.0) * weights[:, None], axis=0)
    total = tl.sum(sums * weights, axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def launches_early(batch: int) -> bool:
    """Whether the decode attention of ``batch`` rows runs under programmatic dependent launch: in steps whose
    linears load their weights first (up to ``linear.prefetch_rows()`` rows), which then stream while the
    attention and its merge run. Between the skinny GEMMs of larger batches the early launches cost time
    (docs/perf/engine.md)."""
    return batch == 1 or batch <= linear.prefetch_rows()


def split_plan(batch: int, num_heads: int, max_context: int, num_splits: int | None, sms: int
               ) -> tuple[int, int, int]:
    """(tile tokens, warps, split tokens) of the decode attention over a block table of ``max_context`` tokens:
    ``num_splits`` given, that many splits of 64-token tiles; None, splits of one tile each where the batch has
    too few (sequence, head) pairs for the ``sms`` SMs, else one unsplit range a pair. ``sms`` 0: the Triton
    interpreter, whose small tiles let tiny test contexts still cross several of them."""
    # (tile, warps): long unsplit ranges stream best in wide tiles on one warp (`benchmarks/kernel_probe.py`;
    # docs/perf/); one-tile splits take _SPLIT_TOKENS-token tiles up to _LONG_SPLIT_ROWS sequences, else 64.
    block_n, num_warps = (64, 4) if sms else (16, 4)
    if num_splits is not None:
        return block_n, num_warps, triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    # Too few pairs to fill the GPU: one KV tile per program. The grid covers the table width, so it suits every
    # context a CUDA graph replays it with; programs past a context return at once.
    few = batch * num_heads < _PROGRAMS_PER_SM * sms
    if few and batch <= _LONG_SPLIT_ROWS:
        block_n = _SPLIT_TOKENS
    elif not few and sms:
        block_n, num_warps = 128, 1
    return block_n, num_warps, block_n if few else max_context


def paged_decode_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                  context_lens: Tensor, scale: float, num_splits: int | None) -> Tensor:
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    # The block table's width bounds every context without reading context_lens back from the GPU.
    max_context = max(block_tables.shape[1] * block_size, 1)
    sms = sm_count(q.device) if q.is_cuda else 0
    block_n, num_warps, split_len = split_plan(batch, num_heads, max_context, num_splits, sms)
    num_splits = triton.cdiv(max_context, split_len)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a view
    split = num_splits > 1
    if split:
        partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        maxes = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
    else:
        partial, maxes, sums = out, out, out  # maxes and sums are unused without splits
    pdl = pdl_launch(q.device if launches_early(batch) else False)
    _decode_kernel[(batch, num_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, partial, maxes, sums, scale * _LOG2E, q.stride(0),
        q.stride(1), block_tables.stride(0), split_len, num_kv_heads, num_heads // num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_N=block_n, SPLIT=split, num_warps=num_warps, **pdl)
    if split:
        _merge_splits_kernel[(batch * num_heads,)](partial, maxes, sums, out, context_lens, num_splits, num_heads,
                                                   split_len, HEAD_DIM=head_dim,
                                                   SPLITS=triton.next_power_of_2(num_splits), num_warps=1,
                                                   **pdl)
    return out
