"""One-row decode GEMV (a batch-1 step's linears), with the layer's neighbours fused in: an optional residual
add + RMSNorm in front, and behind either the SwiGLU gate or, for the q/k/v projection, the rotary embedding
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


@triton.jit
def _inv_rms(x_ptr, res_ptr, res_out_ptr, eps, K: tl.constexpr, BLOCK_K: tl.constexpr,
             HAS_RESIDUAL: tl.constexpr, STORE_RES):
    """1 / rms of the row x (+ residual, rounded to x's dtype); ``STORE_RES``: write that sum to res_out."""
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = ks < K
        x = tl.load(x_ptr + ks, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(res_ptr + ks, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + ks, x, mask=mask & STORE_RES)
        x = x.to(tl.float32)
        squares += x * x
    return tl.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, y_ptr, N, second_offset, eps,
                 pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                 K: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                 ROPE: tl.constexpr, Q_COLS: tl.constexpr, KV_COLS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    if HAS_NORM:
        inv_rms = _inv_rms(x_ptr, res_ptr, res_out_ptr, eps, K, BLOCK_K, HAS_RESIDUAL, pid == 0)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # the up projection (GATED) or the second halves (ROPE)
    for k0 in tl.static_range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        h = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
        if HAS_RESIDUAL:
            h = (h.to(tl.float32) + tl.load(res_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)).to(h.dtype)
        if HAS_NORM:
            nw = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0)
            h = ((h.to(tl.float32) * inv_rms).to(h.dtype).to(tl.float32) * nw.to(tl.float32)).to(nw.dtype)
        h = h.to(tl.float32)[None, :]
        w_offs = cols[:, None] * K + ks[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        acc += tl.load(w_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32) * h
        if GATED or ROPE:
            acc2 += tl.load(w_ptr + second_offset + w_offs, mask=w_mask, other=0.0).to(tl.float32) * h
    out_ty = y_ptr.dtype.element_ty
    y1 = tl.sum(acc, axis=1).to(out_ty).to(tl.float32)
    if GATED:
        up = tl.sum(acc2, axis=1).to(out_ty).to(tl.float32)
        tl.store(y_ptr + cols, (y1 * tl.sigmoid(y1) * up).to(out_ty), mask=col_mask)
    elif ROPE:
        y2 = tl.sum(acc2, axis=1).to(out_ty).to(tl.float32)
        pos = tl.load(pos_ptr).to(tl.int64)
        c = j % HALF
        cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + c)
        sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + c)
        rotated = cols < Q_COLS + KV_COLS  # q and k heads; v is stored as it is
        r1 = tl.where(rotated, y1 * cos - y2 * sin, y1).to(out_ty)
        r2 = tl.where(rotated, y2 * cos + y1 * sin, y2).to(out_ty)
        tl.store(y_ptr + cols, r1, mask=col_mask)
        tl.store(y_ptr + cols + HALF, r2, mask=col_mask)
        slot = tl.load(slot_ptr).to(tl.int64)
        if slot >= 0:  # a negative slot writes no KV
            is_k = col_mask & (cols >= Q_COLS) & rotated
            k_offs = slot * KV_COLS + cols - Q_COLS
            tl.store(k_cache_ptr + k_offs, r1, mask=is_k)
            tl.store(k_cache_ptr + k_offs + HALF, r2, mask=is_k)
            is_v = col_mask & (cols >= Q_COLS + KV_COLS)
            v_offs = slot * KV_COLS + cols - Q_COLS - KV_COLS
            tl.store(v_cache_ptr + v_offs, r1, mask=is_v)
            tl.store(v_cache_ptr + v_offs + HALF, r2, mask=is_v)
    else:
        tl.store(y_ptr + cols, y1.to(out_ty), mask=col_mask)


def gemv_triton(x: Tensor, weight: Tensor, norm_weight: Tensor | None, eps: float, residual: Tensor | None,
                gated: bool, rope: tuple | None = None, *,
                config: tuple[int, int, int] | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """x [1, K] (see ``fused_linear``). ``rope`` = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
    num_heads, num_kv_heads): weight is the stacked q/k/v projection; q and k come back rotated and k, v are
    written to the cache. ``config`` = (BLOCK_N, BLOCK_K, num_warps) overrides the defaults (for tuning)."""
    k = x.shape[1]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    block_n, block_k, num_warps = config or default_config(n, k, gated, rope is not None, x.dtype, x.is_cuda)
    if rope is not None:
        positions, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads = rope
        half = cos_sin.shape[1] // 2
        q_cols, kv_cols, second, programs = num_heads * 2 * half, num_kv_heads * 2 * half, half * k, n // 2
    else:
        positions = cos_sin = k_cache = v_cache = slots = x
        half, q_cols, kv_cols, programs = 1, 0, 0, n
        second = n * k  # the up rows of a gated weight
    _gemv_kernel[(triton.cdiv(programs, block_n),)](
        x, residual if residual is not None else x, res_out, norm_weight if norm_weight is not None else x,
        weight, y, n, second, eps, positions, cos_sin, slots, k_cache, v_cache, K=k,
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, GATED=gated, ROPE=rope is not None,
        Q_COLS=q_cols, KV_COLS=kv_cols, HALF=half, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y if residual is None else (y, res_out)


def default_config(n: int, k: int, gated: bool, rope: bool, dtype: torch.dtype,
                   cuda: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): a few hundred programs for every projection of the model."""
    if not cuda:  # the interpreter: small tiles so tiny test shapes still cross several of them
        return 4, 16, 1
    if gated or rope:
        return 8, 256, 4
    return (4, 512, 4) if k > 1024 else (4, 256, 4)
