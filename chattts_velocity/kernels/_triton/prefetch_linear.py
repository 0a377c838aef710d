"""Decode GEMM for a few rows whose weights stream in before its input exists: the one-row GEMV's scheme
(``gemv.py``) for 2 to ``MAX_PREFETCH_ROWS`` rows. Each program owns BLOCK_N output columns and loads their whole
weight rows (K cut into three chunks, so both model widths are three powers of two) into registers first;
under programmatic dependent launch that happens while the kernel before it is still running, and only then
does it wait for the input rows and multiply them on the tensor cores. The neighbours fuse in as in the GEMV:
an optional residual add + RMSNorm in front, and behind either the SwiGLU gate or, for the q/k/v projection,
the rotary embedding and the KV-cache write (a program then holds a head's column c and c + HALF, the pair the
rotation mixes). Rounding follows the unfused ops, as in the skinny GEMM (``linear.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._launch import pdl_launch
from .gemv import fused_launch, rotate_and_store
from .linear import load_rows, normed

MAX_PREFETCH_ROWS = 64
"""The most rows the kernel takes: every program holds all of them."""


@triton.jit
def _load_weight(w_ptr, cols, col_mask, K: tl.constexpr, CHUNK: tl.constexpr):
    """A program's weight rows [BLOCK_N, K] as three chunks of CHUNK columns."""
    kc = tl.arange(0, CHUNK)
    base = w_ptr + cols[:, None] * K + kc[None, :]
    w0 = tl.load(base, mask=col_mask[:, None] & (kc < K)[None, :], other=0.0)
    w1 = tl.load(base + CHUNK, mask=col_mask[:, None] & (kc + CHUNK < K)[None, :], other=0.0)
    w2 = tl.load(base + 2 * CHUNK, mask=col_mask[:, None] & (kc + 2 * CHUNK < K)[None, :], other=0.0)
    return w0, w1, w2


@triton.jit
def _load_chunk(x_ptr, res_ptr, res_out_ptr, rows, row_mask, k0, K: tl.constexpr, CHUNK: tl.constexpr,
                STORE_RES, HAS_RESIDUAL: tl.constexpr):
    """Rows [BLOCK_M, CHUNK] of x (+ residual) from column k0."""
    ks = k0 + tl.arange(0, CHUNK)
    return load_rows(x_ptr, res_ptr, res_out_ptr, rows, ks, row_mask[:, None] & (ks < K)[None, :], K, STORE_RES,
                     HAS_RESIDUAL)


@triton.jit
def _normed(x, inv_rms, norm_w_ptr, k0, K: tl.constexpr, CHUNK: tl.constexpr):
    """rms_norm(x) * weight for the chunk from column k0."""
    ks = k0 + tl.arange(0, CHUNK)
    return normed(x, inv_rms[:, None], tl.load(norm_w_ptr + ks, mask=ks < K, other=0.0)[None, :])


@triton.jit
def _chunk_dot(h, w, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(h, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(h, tl.trans(w), acc)


@triton.jit
def _prefetch_linear_kernel(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, y_ptr, M, N, second_offset, eps,
                            pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                            K: tl.constexpr, CHUNK: tl.constexpr, HAS_NORM: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, ROPE: tl.constexpr,
                            Q_COLS: tl.constexpr, KV_COLS: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()  # the next kernel may start and fetch its weights now
    pid = tl.program_id(0)
    j = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if ROPE:  # j counts half-columns: the program holds column c of a head's first half and c + HALF
        cols = (j // HALF) * (2 * HALF) + j % HALF
        col_mask = j < N // 2
    else:
        cols = j
        col_mask = j < N
    # the whole weight rows first: nothing before this kernel writes them
    w0, w1, w2 = _load_weight(w_ptr, cols, col_mask, K, CHUNK)
    if GATED or ROPE:  # the up projection's rows (GATED) or the heads' second halves (ROPE)
        u0, u1, u2 = _load_weight(w_ptr + second_offset, cols, col_mask, K, CHUNK)
    if PDL:
        gdc_wait()  # the input rows (and every buffer written below) belong to the kernels before this one
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    store_res = pid == 0
    if HAS_NORM:
        x0 = _load_chunk(x_ptr, res_ptr, res_out_ptr, rows, row_mask, 0, K, CHUNK, store_res, HAS_RESIDUAL)
        x1 = _load_chunk(x_ptr, res_ptr, res_out_ptr, rows, row_mask, CHUNK, K, CHUNK, store_res, HAS_RESIDUAL)
        x2 = _load_chunk(x_ptr, res_ptr, res_out_ptr, rows, row_mask, 2 * CHUNK, K, CHUNK, store_res,
                         HAS_RESIDUAL)
        x0f, x1f, x2f = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32)
        squares = tl.sum(x0f * x0f, axis=1) + tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)
        inv_rms = tl.rsqrt(squares / K + eps)
        h0 = _normed(x0, inv_rms, norm_w_ptr, 0, K, CHUNK)
        h1 = _normed(x1, inv_rms, norm_w_ptr, CHUNK, K, CHUNK)
        h2 = _normed(x2, inv_rms, norm_w_ptr, 2 * CHUNK, K, CHUNK)
    else:
        h0 = _load_chunk(x_ptr, res_ptr, res_out_ptr, rows, row_mask, 0, K, CHUNK, store_res, HAS_RESIDUAL)
        h1 = _load_chunk(x_ptr, res_ptr, res_out_ptr, rows, row_mask, CHUNK, K, CHUNK, store_res, HAS_RESIDUAL)
        h2 = _load_chunk(x_ptr, res_ptr, res_out_ptr, rows, row_mask, 2 * CHUNK, K, CHUNK, store_res,
                         HAS_RESIDUAL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _chunk_dot(h0, w0, acc, IEEE)
    acc = _chunk_dot(h1, w1, acc, IEEE)
    acc = _chunk_dot(h2, w2, acc, IEEE)
    out_ty = y_ptr.dtype.element_ty
    y1 = acc.to(out_ty).to(tl.float32)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if GATED or ROPE:
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = _chunk_dot(h0, u0, acc2, IEEE)
        acc2 = _chunk_dot(h1, u1, acc2, IEEE)
        acc2 = _chunk_dot(h2, u2, acc2, IEEE)
        y2 = acc2.to(out_ty).to(tl.float32)
    if GATED:  # the unfused path rounds the projections to the dtype, then gates in float32
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], (y1 * tl.sigmoid(y1) * y2).to(out_ty), mask=out_mask)
    elif ROPE:
        pos = tl.load(pos_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
        rotate_and_store(y_ptr, rows[:, None] * N + cols[None, :], y1, y2, pos[:, None], slot[:, None],
                         cols[None, :], (j % HALF)[None, :], out_mask, cos_sin_ptr, k_cache_ptr, v_cache_ptr,
                         Q_COLS, KV_COLS, HALF)
    else:
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y1.to(out_ty), mask=out_mask)


def prefetch_linear_triton(x: Tensor, weight: Tensor, norm_weight: Tensor | None, eps: float,
                           residual: Tensor | None, gated: bool, rope: tuple | None = None, *,
                           config: tuple[int, int] | None = None, pdl: bool | None = None,
                           out: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """x [M, K], 2 <= M <= ``MAX_PREFETCH_ROWS`` (see ``fused_linear``). ``rope`` = (positions [M],
    cos_sin_cache, k_cache, v_cache, slot_mapping [M], num_heads, num_kv_heads): weight is the stacked q/k/v
    projection; q and k come back rotated and k, v are written to the cache. ``out``: the [M, N] output, else
    a new one. ``config`` = (BLOCK_N, num_warps) and ``pdl`` override the defaults (for tuning)."""
    y, res_out, columns, args, meta = fused_launch(x, weight, norm_weight, eps, residual, gated, rope, out)
    m, k = x.shape
    block_n, num_warps = config or default_config(k, gated, rope is not None, x.is_cuda)
    _prefetch_linear_kernel[(triton.cdiv(columns, block_n),)](
        *args, CHUNK=max(16, triton.next_power_of_2(triton.cdiv(k, 3))), BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, IEEE=x.dtype == torch.float32, num_warps=num_warps, **meta,
        **pdl_launch(x.device if pdl is None else pdl))
    return y if residual is None else (y, res_out)


def default_config(k: int, gated: bool, rope: bool, cuda: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps): the fastest of a sweep under programmatic dependent launch
    (`benchmarks/kernel_probe.py --parts prefetch`; docs/perf/)."""
    if not cuda:  # the interpreter
        return 16, 1
    if rope:
        return 32, 8
    if gated:
        return 64, 8
    return (32, 4) if k > 1024 else (64, 4)
