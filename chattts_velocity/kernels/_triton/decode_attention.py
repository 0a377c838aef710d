"""Paged decode attention: one program per (sequence, q head, context split), online softmax over KV tiles.

With several splits (flash-decoding) each program leaves an unnormalised partial result with its running max
and sum, and the splits are merged. A batch with fewer (sequence, head) pairs than SMs needs that to use the
whole GPU: batch 1 alone keeps only as many SMs busy as the model has heads. At one or two sequences the
contexts split into one-tile ranges of ``_tile_split_kernel``, whose programs load their keys and values before
they wait for the kernel before them (under programmatic dependent launch: all but each sequence's newest token
were cached by earlier steps) and, given the caller's counters, the last split of a head to finish merges
them, so the merge is no launch of its own. Other batches and a given split count run ``_decode_kernel`` (a
loop over tiles) and, split, ``_merge_splits_kernel``.
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
# Fewer (sequence, head) pairs than this many per SM get flash-decoding splits of one _SPLIT_TOKENS-token tile
# each (in large batches splitting only added time): at 1 to 21 sequences and contexts of 100 to 1,000 tokens
# 256-token splits on four warps beat 64-token ones in all but the shorter contexts of 2 sequences, and wide
# unsplit tiles at the longer contexts (`benchmarks/kernel_probe.py --parts attention_splits`; docs/perf/).
_PROGRAMS_PER_SM = 2
_SPLIT_TOKENS = 256
# From this many (sequence, head) pairs per SM the unsplit kernel runs one-block tiles on one warp (loading each
# tile's values beside its keys, which was as fast at 16 tokens and faster for 32-64-token tiles): small
# programs, many of them resident, stream the cache faster than wide tiles where the GPU is full (at 128 and 256
# sequences), and slower where it is not (64) (`benchmarks/kernel_probe.py --parts attention_sweep`;
# docs/perf/engine.md).
_SMALL_TILE_PAIRS_PER_SM = 8
_BLOCK_TILE_PAIRS_PER_SM = 16
# ... and from this many, one-block (16-token) tiles rather than 32-token ones (96 to 128 sequences: 32 tokens
# faster, 256: 16)
# Up to _TILE_SPLIT_ROWS sequences launched early (and given counters to merge with) the splitting kernel runs,
# on _TILE_SPLIT (tile tokens, warps): in the engine's step it loads its keys and values while the q/k/v
# projection runs and drops the merge launch; at 4 and 8 sequences (the next CUDA-graph buckets) the looping
# kernel was as fast or faster (`chattts-velocity bench`, `benchmarks/kernel_probe.py --parts
# attention_splits`; docs/perf/engine.md).
_TILE_SPLIT_ROWS = 2
_TILE_SPLIT = (128, 4)


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, max_ptr,
                   sum_ptr, qk_scale, q_stride_seq, q_stride_head, bt_stride, split_len, num_kv_heads, group,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, VALUES_EARLY: tl.constexpr, PDL: tl.constexpr):
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
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        if VALUES_EARLY:  # in flight beside the keys (a small tile's registers allow it)
            v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        scores = tl.where(valid, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))  # [BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new)
        if not VALUES_EARLY:
            v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
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
    row = tl.program_id(0)
    # only the splits that hold context tokens: the rest of the grid sized for the table width was empty
    live = tl.minimum(tl.cdiv(tl.load(context_lens_ptr + row // num_heads), split_len), num_splits)
    _merge_row(acc_ptr, max_ptr, sum_ptr, out_ptr, row, num_splits, live, HEAD_DIM, SPLITS)


@triton.jit
def _tile_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, early_lens_ptr, context_lens_ptr,
                       out_ptr, part_ptr, max_ptr, sum_ptr, counters_ptr, qk_scale, q_stride_seq, q_stride_head,
                       bt_stride, table_tokens, num_kv_heads, group, num_splits,
                       BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                       SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One program per (sequence, q head, BLOCK_N-token split). ``early_lens`` is read before the wait and may
    be stale or garbage: keys and values it places before a context's newest token are loaded early and kept
    only where the real context (read after the wait) agrees; the rest of the tile is loaded after the wait."""
    if PDL:
        gdc_launch_dependents()
    seq, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = seq * tl.num_programs(1) + head  # index of (seq, head) in out
    start = split * BLOCK_N
    tokens = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride
    kv_head_offset = (head // group) * HEAD_DIM
    row_stride = num_kv_heads * HEAD_DIM
    # Before the wait: tokens that earlier steps cached, as far as early_lens tells (nothing this step writes);
    # a split wholly past them (most of the grid) loads nothing
    early_end = tl.minimum(tl.load(early_lens_ptr + seq) - 1, table_tokens)
    k_early = tl.zeros([BLOCK_N, HEAD_DIM], k_cache_ptr.dtype.element_ty)
    v_early = tl.zeros([BLOCK_N, HEAD_DIM], v_cache_ptr.dtype.element_ty)
    if start < early_end:
        early = tokens < early_end
        offs = kv_offsets(bt_row, tokens, early, kv_head_offset, row_stride, BLOCK_SIZE)[:, None] + dims[None, :]
        k_early = tl.load(k_cache_ptr + offs, mask=early[:, None], other=0.0)
        v_early = tl.load(v_cache_ptr + offs, mask=early[:, None], other=0.0)
    if PDL:
        gdc_wait()
    ctx = tl.load(context_lens_ptr + seq)
    live = tl.cdiv(ctx, BLOCK_N)  # splits holding context tokens; the grid spans the block table's width
    if (live == 0) & (split == 0):  # an empty context gives zeros
        tl.store(out_ptr + row.to(tl.int64) * HEAD_DIM + dims, tl.zeros([HEAD_DIM], out_ptr.dtype.element_ty))
    if split < live:
        valid = tokens < ctx
        kept_end = tl.minimum(early_end, ctx - 1)  # loaded early and cached before this step
        k, v = k_early, v_early
        if start + BLOCK_N > kept_end:  # the rest of the split: its newest tokens, or all if early_lens erred
            kept = tokens < kept_end
            late = valid & ~kept
            offs = kv_offsets(bt_row, tokens, late, kv_head_offset, row_stride, BLOCK_SIZE)[:, None] + dims[None, :]
            k = tl.where(kept[:, None], k_early, tl.load(k_cache_ptr + offs, mask=late[:, None], other=0.0))
            v = tl.where(kept[:, None], v_early, tl.load(v_cache_ptr + offs, mask=late[:, None], other=0.0))
        q = tl.load(q_ptr + seq.to(tl.int64) * q_stride_seq + head * q_stride_head + dims).to(tl.float32)
        scores = tl.sum(k.to(tl.float32) * (q * qk_scale)[None, :], axis=1)  # log2 units, for exp2
        scores = tl.where(valid, scores, float("-inf"))
        m = tl.max(scores, axis=0)  # finite: the split holds a context token
        p = tl.exp2(scores - m)
        acc = tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        total = tl.sum(p, axis=0)
        if live == 1:
            tl.store(out_ptr + row.to(tl.int64) * HEAD_DIM + dims, (acc / total).to(out_ptr.dtype.element_ty))
        else:
            part = row * num_splits + split
            tl.store(max_ptr + part, m)
            tl.store(sum_ptr + part, total)
            tl.store(part_ptr + part.to(tl.int64) * HEAD_DIM + dims, acc)
            # the last split of the head to get here merges them all, in split order (the same bits whichever
            # finishes last), and puts the counter back for the next call
            tl.debug_barrier()  # every thread's stores before the count that publishes them
            if tl.atomic_add(counters_ptr + row, 1, sem="acq_rel") == live - 1:
                _merge_row(part_ptr, max_ptr, sum_ptr, out_ptr, row, num_splits, live, HEAD_DIM, SPLITS)
                tl.store(counters_ptr + row, 0)


@triton.jit
def _merge_row(part_ptr, max_ptr, sum_ptr, out_ptr, row, num_splits, live, HEAD_DIM: tl.constexpr,
               SPLITS: tl.constexpr):
    """out[row] from the first ``live`` of its ``num_splits`` partial results (unnormalised sums, their
    maxima in log2 units and their softmax sums), read past the L1 cache: other SMs may have written them. No
    live split (an empty context) gives zeros."""
    row = row.to(tl.int64)
    splits = tl.arange(0, SPLITS)
    valid = splits < live
    maxes = tl.load(max_ptr + row * num_splits + splits, mask=valid, other=float("-inf"), cache_modifier=".cg")
    sums = tl.load(sum_ptr + row * num_splits + splits, mask=valid, other=0.0, cache_modifier=".cg")
    top = tl.max(maxes, axis=0)
    weights = tl.exp2(maxes - tl.where(top == float("-inf"), 0.0, top))  # [SPLITS]; the invalid ones weigh 0
    dims = tl.arange(0, HEAD_DIM)
    offs = (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :]
    acc = tl.sum(tl.load(part_ptr + offs, mask=valid[:, None], other=0.0, cache_modifier=".cg")
                 * weights[:, None], axis=0)
    total = tl.sum(sums * weights, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + dims, (acc / tl.where(total > 0, total, 1.0)).to(out_ptr.dtype.element_ty))


def launches_early(batch: int) -> bool:
    """Whether the decode attention of ``batch`` rows runs under programmatic dependent launch: in steps whose
    linears load their weights first (up to ``linear.prefetch_rows()`` rows), which then stream while the
    attention and its merge run. Between the skinny GEMMs of larger batches the early launches cost time
    (docs/perf/engine.md)."""
    return batch == 1 or batch <= linear.prefetch_rows()


def merges_in_kernel(batch: int, early: bool, split_len: int, max_context: int, num_splits: int | None,
                     has_counters: bool) -> bool:
    """Whether the decode attention of ``batch`` rows runs the splitting kernel (early loads, the merge in the
    kernel): few enough rows launched ``early`` (``launches_early``), a split plan of its own (``split_len``
    under the table's ``max_context``) and counters to merge with."""
    return early and batch <= _TILE_SPLIT_ROWS and has_counters and num_splits is None and split_len < max_context


def split_plan(batch: int, num_heads: int, max_context: int, num_splits: int | None, sms: int
               ) -> tuple[int, int, int, bool]:
    """(tile tokens, warps, split tokens, values loaded beside the keys) of the decode attention over a block
    table of ``max_context`` tokens: ``num_splits`` given, that many splits of 64-token tiles; None, splits of
    one tile each where the batch has too few (sequence, head) pairs for the ``sms`` SMs, else one unsplit range
    a pair. ``sms`` 0: the Triton interpreter, whose small tiles let tiny test contexts still cross several of
    them (unsplit, it loads the values beside the keys)."""
    # (tile, warps): long unsplit ranges stream best in wide tiles on one warp while the GPU is not full, in
    # one-block tiles with the values early once it is, one-tile splits in _SPLIT_TOKENS-token tiles on four
    # (`benchmarks/kernel_probe.py`; docs/perf/)
    block_n, num_warps = (64, 4) if sms else (16, 4)
    if num_splits is not None:
        return block_n, num_warps, triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n, False
    # Too few pairs to fill the GPU: one KV tile per program. The grid covers the table width, so it suits every
    # context a CUDA graph replays it with; programs past a context return at once.
    pairs = batch * num_heads
    if pairs < _PROGRAMS_PER_SM * sms:
        return _SPLIT_TOKENS, num_warps, _SPLIT_TOKENS, False
    if pairs >= _SMALL_TILE_PAIRS_PER_SM * sms:
        if not sms:
            return block_n, num_warps, max_context, True
        return 16 if pairs >= _BLOCK_TILE_PAIRS_PER_SM * sms else 32, 1, max_context, True
    return 128, 1, max_context, False


def paged_decode_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                  context_lens: Tensor, scale: float, num_splits: int | None,
                                  split_counters: Tensor | None = None) -> Tensor:
    batch, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    # The block table's width bounds every context without reading context_lens back from the GPU.
    max_context = max(block_tables.shape[1] * block_size, 1)
    sms = sm_count(q.device) if q.is_cuda else 0
    block_n, num_warps, split_len, values_early = split_plan(batch, num_heads, max_context, num_splits, sms)
    early = launches_early(batch)
    pdl = pdl_launch(q.device if early else False)
    if merges_in_kernel(batch, early, split_len, max_context, num_splits, split_counters is not None):
        return tile_splits(q, k_cache, v_cache, block_tables, context_lens, scale, *_TILE_SPLIT, split_counters,
                           context_lens, pdl)
    num_splits = triton.cdiv(max_context, split_len)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a view
    split = num_splits > 1
    partial, maxes, sums = _partials(q, num_splits) if split else (out, out, out)  # (unused without splits)
    _decode_kernel[(batch, num_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, partial, maxes, sums, scale * _LOG2E, q.stride(0),
        q.stride(1), block_tables.stride(0), split_len, k_cache.shape[2], num_heads // k_cache.shape[2],
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_N=block_n, SPLIT=split, VALUES_EARLY=values_early,
        num_warps=num_warps, **pdl)
    if split:
        _merge(partial, maxes, sums, out, context_lens, split_len, pdl)
    return out


def tile_splits(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                scale: float, block_n: int, num_warps: int, split_counters: Tensor, early_lens: Tensor,
                pdl: dict) -> Tensor:
    """The decode attention in splits of one ``block_n``-token tile over the block table's width, merged in the
    kernel with ``split_counters`` (zeros, one per (sequence, head); zeros again after the call).
    ``early_lens`` is read before the wait for the kernel before (the engine passes context_lens, which the step
    wrote; any value gives the same result)."""
    batch, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    table_tokens = block_tables.shape[1] * block_size
    num_splits = triton.cdiv(max(table_tokens, 1), block_n)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    partial, maxes, sums = _partials(q, num_splits)
    _tile_split_kernel[(batch, num_heads, num_splits)](
        q, k_cache, v_cache, block_tables, early_lens, context_lens, out, partial, maxes, sums, split_counters,
        scale * _LOG2E, q.stride(0), q.stride(1), block_tables.stride(0), table_tokens, k_cache.shape[2],
        num_heads // k_cache.shape[2], num_splits, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_N=block_n,
        SPLITS=triton.next_power_of_2(num_splits), num_warps=num_warps, **pdl)
    return out


def _partials(q: Tensor, num_splits: int) -> tuple[Tensor, Tensor, Tensor]:
    """The splits' unnormalised results [B, Hq, splits, D], maxima and sums [B, Hq, splits] (float32)."""
    batch, num_heads, head_dim = q.shape
    partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    maxes = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    return partial, maxes, torch.empty_like(maxes)


def _merge(partial: Tensor, maxes: Tensor, sums: Tensor, out: Tensor, context_lens: Tensor, split_len: int,
           pdl: dict) -> None:
    batch, num_heads, num_splits, head_dim = partial.shape
    _merge_splits_kernel[(batch * num_heads,)](partial, maxes, sums, out, context_lens, num_splits, num_heads,
                                               split_len, HEAD_DIM=head_dim,
                                               SPLITS=triton.next_power_of_2(num_splits), num_warps=1, **pdl)
