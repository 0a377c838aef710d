"""Decode GEMV for one row (a batch-1 step's linears) or a few in turn, with the layer's neighbours fused in:
an optional residual add + RMSNorm in front, and behind either the SwiGLU gate or, for the q/k/v projection, the rotary embedding
and the KV-cache write (so a batch-1 layer has no separate rotary launch).

Unlike the skinny GEMM (``linear.py``, tensor-core dots over 16 padded rows) a program here multiplies its
weight rows by the one input row on the CUDA cores and owns only a few output columns, so a projection is
spread over a few hundred programs and the weights stream from every SM at once: at one row the linears are
bound by how many loads are in flight, not by arithmetic. Rounding follows the unfused ops: the normalised
input is rounded to the dtype, the products accumulate in float32, each projection is rounded to the dtype
before the gate or the rotation, which run in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._launch import pdl_launch
from .linear import normed


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, y_ptr, M, N, second_offset, eps,
                 pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                 K: tl.constexpr, K_PAD: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 GATED: tl.constexpr, ROPE: tl.constexpr, Q_COLS: tl.constexpr, KV_COLS: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()  # the next kernel may start and fetch its weights now
    pid = tl.program_id(0)
    j = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if ROPE:
        # j counts half-columns: the program holds column c of a head's first half and c + HALF, the pair
        # the rotation mixes
        cols = (j // HALF) * (2 * HALF) + j % HALF
        col_mask = j < N // 2
    else:
        cols = j
        col_mask = j < N
    ks = tl.arange(0, K_PAD)
    k_mask = ks < K
    # the program's whole weight rows first: nothing before this kernel writes them, so under programmatic
    # dependent launch they stream in while the previous kernel is still running
    w_offs = cols[:, None] * K + ks[None, :]
    w_mask = col_mask[:, None] & k_mask[None, :]
    w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
    w2 = w  # (unused)
    if GATED or ROPE:  # the up projection's rows (GATED) or the heads' second halves (ROPE)
        w2 = tl.load(w_ptr + second_offset + w_offs, mask=w_mask, other=0.0)
    if PDL:
        gdc_wait()  # the input rows (and every buffer written below) belong to the kernels before this one
    for r in range(M):  # each row against the weights in registers
        _gemv_row(x_ptr + r * K, res_ptr + r * K, res_out_ptr + r * K, norm_w_ptr, y_ptr + r * N, w, w2, eps,
                  pos_ptr + r, cos_sin_ptr, slot_ptr + r, k_cache_ptr, v_cache_ptr, pid, j, cols, col_mask, ks,
                  k_mask, K, HAS_NORM, HAS_RESIDUAL, GATED, ROPE, Q_COLS, KV_COLS, HALF)


@triton.jit
def rotate_and_store(y_ptr, y_offs, y1, y2, pos, slot, cols, c, mask, cos_sin_ptr, k_cache_ptr, v_cache_ptr,
                     Q_COLS: tl.constexpr, KV_COLS: tl.constexpr, HALF: tl.constexpr):
    """The q/k/v projection's epilogue: y1 and y2 (float32) are columns ``cols`` of the heads' first halves and
    the matching second halves (column ``c`` of the half) at positions ``pos``: q and k are rotated, the pairs
    stored at ``y_offs`` and ``y_offs + HALF``, and k and v written to the cache at ``slot`` (a negative slot
    writes no KV). Every argument broadcasts: one row (scalar pos and slot) or rows x columns."""
    out_ty = y_ptr.dtype.element_ty
    cs = cos_sin_ptr + pos * (2 * HALF) + c
    cos = tl.load(cs, mask=mask, other=0.0)
    sin = tl.load(cs + HALF, mask=mask, other=0.0)
    rotated = cols < Q_COLS + KV_COLS  # q and k heads; v is stored as it is
    r1 = tl.where(rotated, y1 * cos - y2 * sin, y1).to(out_ty)
    r2 = tl.where(rotated, y2 * cos + y1 * sin, y2).to(out_ty)
    tl.store(y_ptr + y_offs, r1, mask=mask)
    tl.store(y_ptr + y_offs + HALF, r2, mask=mask)
    stored = mask & (slot >= 0)
    is_k = stored & (cols >= Q_COLS) & rotated
    k_offs = slot * KV_COLS + cols - Q_COLS
    tl.store(k_cache_ptr + k_offs, r1, mask=is_k)
    tl.store(k_cache_ptr + k_offs + HALF, r2, mask=is_k)
    is_v = stored & (cols >= Q_COLS + KV_COLS)
    v_offs = slot * KV_COLS + cols - Q_COLS - KV_COLS
    tl.store(v_cache_ptr + v_offs, r1, mask=is_v)
    tl.store(v_cache_ptr + v_offs + HALF, r2, mask=is_v)


@triton.jit
def _gemv_row(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, y_ptr, w, w2, eps, pos_ptr, cos_sin_ptr, slot_ptr,
              k_cache_ptr, v_cache_ptr, pid, j, cols, col_mask, ks, k_mask, K: tl.constexpr,
              HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, ROPE: tl.constexpr,
              Q_COLS: tl.constexpr, KV_COLS: tl.constexpr, HALF: tl.constexpr):
    h = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(res_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(res_out_ptr + ks, h, mask=k_mask & (pid == 0))
    if HAS_NORM:
        hf = h.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(hf * hf, axis=0) / K + eps)
        h = normed(h, inv_rms, tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0))
    h = h.to(tl.float32)[None, :]
    out_ty = y_ptr.dtype.element_ty
    y1 = tl.sum(w.to(tl.float32) * h, axis=1).to(out_ty).to(tl.float32)
    if GATED:
        up = tl.sum(w2.to(tl.float32) * h, axis=1).to(out_ty).to(tl.float32)
        tl.store(y_ptr + cols, (y1 * tl.sigmoid(y1) * up).to(out_ty), mask=col_mask)
    elif ROPE:
        y2 = tl.sum(w2.to(tl.float32) * h, axis=1).to(out_ty).to(tl.float32)
        rotate_and_store(y_ptr, cols, y1, y2, tl.load(pos_ptr).to(tl.int64), tl.load(slot_ptr).to(tl.int64), cols,
                         j % HALF, col_mask, cos_sin_ptr, k_cache_ptr, v_cache_ptr, Q_COLS, KV_COLS, HALF)
    else:
        tl.store(y_ptr + cols, y1.to(out_ty), mask=col_mask)


def gemv_triton(x: Tensor, weight: Tensor, norm_weight: Tensor | None, eps: float, residual: Tensor | None,
                gated: bool, rope: tuple | None = None, *,
                config: tuple[int, int] | None = None, pdl: bool | None = None,
                out: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """x [M, K], a few rows, each multiplied in turn by the weights a program holds (see ``fused_linear``).
    ``rope`` = (positions [M], cos_sin_cache, k_cache, v_cache, slot_mapping [M], num_heads, num_kv_heads):
    weight is the stacked q/k/v projection; q and k come back rotated and k, v are written to the cache.
    ``out``: the [M, N] output, else a new one. ``config`` = (BLOCK_N, num_warps) and
    ``pdl`` override the defaults (for tuning)."""
    y, res_out, columns, args, meta = fused_launch(x, weight, norm_weight, eps, residual, gated, rope, out)
    n, k = y.shape[1], x.shape[1]
    block_n, num_warps = config or default_config(n, k, gated, rope is not None, x.is_cuda)
    _gemv_kernel[(triton.cdiv(columns, block_n),)](*args, K_PAD=triton.next_power_of_2(k), BLOCK_N=block_n,
                                                   num_warps=num_warps, **meta,
                                                   **pdl_launch(x.device if pdl is None else pdl))
    return y if residual is None else (y, res_out)


def fused_launch(x: Tensor, weight: Tensor, norm_weight: Tensor | None, eps: float, residual: Tensor | None,
                 gated: bool, rope: tuple | None, out: Tensor | None) -> tuple[Tensor, Tensor, int, tuple, dict]:
    """What the GEMV and the prefetching GEMM launch with alike: the output y [M, N], the new residual's
    buffer, the columns the grid covers (column pairs under ``rope``), the kernel's leading arguments and the
    constexprs of its front (norm, residual) and epilogue (SwiGLU, or the rotation and the KV write)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    res_out = torch.empty_like(x) if residual is not None else x
    if rope is not None:
        positions, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads = rope
        half = cos_sin.shape[1] // 2
        q_cols, kv_cols, second, columns = num_heads * 2 * half, num_kv_heads * 2 * half, half * k, n // 2
    else:
        positions = cos_sin = k_cache = v_cache = slots = x
        half, q_cols, kv_cols, columns = 1, 0, 0, n
        second = n * k  # the up rows of a gated weight
    args = (x, residual if residual is not None else x, res_out, norm_weight if norm_weight is not None else x,
            weight, y, m, n, second, eps, positions, cos_sin, slots, k_cache, v_cache)
    meta = dict(K=k, HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, GATED=gated,
                ROPE=rope is not None, Q_COLS=q_cols, KV_COLS=kv_cols, HALF=half)
    return y, res_out, columns, args, meta


def default_config(n: int, k: int, gated: bool, rope: bool, cuda: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps): a few hundred programs for every projection of the model. The CUDA picks are the
    fastest of a sweep under programmatic dependent launch, each well ahead of the skinny GEMM
    (`benchmarks/kernel_probe.py --parts gemv`; docs/perf/)."""
    if not cuda:  # the interpreter: small tiles so tiny test shapes still cross several of them
        return 4, 1
    if gated or rope:
        return 2, 1
    return (4, 8) if k > 1024 else (4, 2)
