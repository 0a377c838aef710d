"""Skinny GEMM for decode batches (up to ``MAX_FUSED_ROWS`` rows): one program per BLOCK_N output columns holds every row, so
each weight tile is read from memory once. The optional residual add + RMSNorm runs in front (every program
recomputes the rows' norms, which are tiny next to its weight tile; program 0 stores the new residual) and the
optional SwiGLU gate behind (the program also accumulates the matching up-projection columns)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def load_rows(x_ptr, res_ptr, res_out_ptr, rows, cols, mask, K: tl.constexpr, STORE_RES,
              HAS_RESIDUAL: tl.constexpr):
    """x rows (+ residual, rounded to x's dtype like the unfused add) for columns ``cols``."""
    offs = rows[:, None] * K + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        if STORE_RES:
            tl.store(res_out_ptr + offs, x, mask=mask)
    return x


@triton.jit
def normed(x, inv_rms, nw):
    """rms_norm(x) * nw, with ``inv_rms`` broadcast to x: rounded to x's dtype before the weight multiply, as
    the unfused norm does, and the product to the weight's."""
    return ((x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32) * nw.to(tl.float32)).to(nw.dtype)


@triton.jit
def _fused_linear_kernel(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, y_ptr, M, N, up_offset, eps,
                         K: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr):
    # K (a model width) is a constexpr, so the K loops have constant trip counts
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
    col_mask = cols < N
    store_res = pid == 0
    if HAS_NORM:
        squares = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = load_rows(x_ptr, res_ptr, res_out_ptr, rows, ks, row_mask[:, None] & (ks < K)[None, :], K,
                          store_res, HAS_RESIDUAL).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        inv_rms = tl.rsqrt(squares / K + eps)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        h = load_rows(x_ptr, res_ptr, res_out_ptr, rows, ks, row_mask[:, None] & k_mask[None, :], K, False,
                      HAS_RESIDUAL)
        if HAS_NORM:
            h = normed(h, inv_rms[:, None], tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0)[None, :])
        w_offs = cols[:, None] * K + ks[None, :]  # [BLOCK_N, BLOCK_K]
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
        if IEEE:
            acc += tl.dot(h, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(h, tl.trans(w))
        if GATED:
            up = tl.load(w_ptr + up_offset + w_offs, mask=w_mask, other=0.0)
            if IEEE:
                acc_up += tl.dot(h, tl.trans(up), input_precision="ieee")
            else:
                acc_up += tl.dot(h, tl.trans(up))
    out_ty = y_ptr.dtype.element_ty
    out = acc.to(out_ty)
    if GATED:
        # the unfused path rounds the projections to the dtype, then gates in float32
        gate = out.to(tl.float32)
        out = (gate * tl.sigmoid(gate) * acc_up.to(out_ty).to(tl.float32)).to(out_ty)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], out, mask=row_mask[:, None] & col_mask[None, :])


def fused_linear_triton(x: Tensor, weight: Tensor, norm_weight: Tensor | None, eps: float,
                        residual: Tensor | None, gated: bool, *,
                        config: tuple[int, int, int] | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """``config`` = (BLOCK_N, BLOCK_K, num_warps) overrides the defaults (for tuning)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    block_n, block_k, num_warps = config or _default_config(n, gated, x.dtype, x.is_cuda)
    block_m = max(16, triton.next_power_of_2(m))
    _fused_linear_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, res_out, norm_weight if norm_weight is not None else x,
        weight, y, m, n, n * k, eps, K=k, HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
        num_warps=num_warps)
    return y if residual is None else (y, res_out)


def _default_config(n: int, gated: bool, dtype: torch.dtype, cuda: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). The CUDA picks are the fastest of a sweep at M = 1 and 16
    (`benchmarks/kernel_probe.py`; docs/perf/): narrow column blocks for the narrow outputs (o, down), so more
    programs."""
    if not cuda:  # the interpreter: small tiles so tiny test shapes still cross several of them
        return 16, 16, 1
    if dtype == torch.float32:  # 4-byte tiles: the 16-bit picks would overflow shared memory
        return (32 if gated else 16), 64, 4
    if gated:
        return 64, 256, 4
    return (32, 256, 4) if n > 1024 else (16, 256, 2)
