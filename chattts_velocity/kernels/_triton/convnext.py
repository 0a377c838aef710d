"""The ConvNeXt block of the wav decode (the Decoder's and Vocos's), channels last: a depthwise convolution
over time fused with the LayerNorm behind it, and a tiled GEMM whose epilogue adds the bias and applies GELU,
or scales by the layer scale and adds the residual. Values stored as float16 saturate at its largest finite
value rather than becoming infinite."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import num_warps_for

FP16_MAX = tl.constexpr(65504.0)


# Not specialised on the row counts (T, M): Triton would compile a variant per value class of an int argument
# (1, a multiple of 16, other), and a decode of a new class in a warmed-up server would stall on the compile.
@triton.jit(do_not_specialize=["T"])
def _dwconv_norm_kernel(x_ptr, cw_ptr, cb_ptr, nw_ptr, nb_ptr, len_ptr, y_ptr, T, C, eps,
                        KSIZE: tl.constexpr, DILATION: tl.constexpr, PAD: tl.constexpr, LENGTHS: tl.constexpr,
                        SATURATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_C)
    cmask = c < C
    base = x_ptr + b * T * C
    end = T
    if LENGTHS:  # the row's own length: its frames from there on read as zeros
        end = tl.load(len_ptr + b)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32) + tl.load(cb_ptr + c, mask=cmask, other=0.0)[None, :]
    for k in tl.static_range(KSIZE):
        src = t + k * DILATION - PAD  # zero padding at both ends, as the convolution's
        inside = (src >= 0) & (src < end)
        xv = tl.load(base + src[:, None] * C + c[None, :], mask=inside[:, None] & cmask[None, :], other=0.0)
        w = tl.load(cw_ptr + c * KSIZE + k, mask=cmask, other=0.0)
        acc += xv.to(tl.float32) * w[None, :]  # 0 past C: bias, weights and x load as 0 there
    mean = tl.sum(acc, axis=1) / C
    d = tl.where(cmask[None, :], acc - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(d * d, axis=1) / C + eps)
    nw = tl.load(nw_ptr + c, mask=cmask, other=0.0)
    nb = tl.load(nb_ptr + c, mask=cmask, other=0.0)
    y = d * rstd[:, None] * nw[None, :] + nb[None, :]
    if SATURATE:
        y = tl.clamp(y, -FP16_MAX, FP16_MAX)
    tl.store(y_ptr + b * T * C + t[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & cmask[None, :])


def dwconv_norm_triton(x: Tensor, conv_weight: Tensor, conv_bias: Tensor, dilation: int, padding: int,
                       norm_weight: Tensor, norm_bias: Tensor, eps: float, out_dtype: torch.dtype,
                       lengths: Tensor | None = None) -> Tensor:
    b, t, c = x.shape
    ksize = conv_weight.shape[-1]
    y = torch.empty((b, t, c), dtype=out_dtype, device=x.device)
    block_c = triton.next_power_of_2(c)
    block_t = max(1, min(16, 8192 // block_c))
    grid = (triton.cdiv(t, block_t), b)
    _dwconv_norm_kernel[grid](x, conv_weight, conv_bias, norm_weight, norm_bias,
                              x if lengths is None else lengths, y, t, c, eps,
                              KSIZE=ksize, DILATION=dilation, PAD=padding, LENGTHS=lengths is not None, SATURATE=out_dtype == torch.float16,
                              BLOCK_T=block_t, BLOCK_C=block_c,
                              num_warps=num_warps_for(block_t * block_c))
    return y


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, out_ptr, M, N, K,
                   GELU: tl.constexpr, RESIDUAL: tl.constexpr, PRECISION: tl.constexpr, SATURATE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # tiles in groups of GROUP_M row blocks, so the weight tiles a group reads stay in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * K  # the weight is [N, K]: its tile read as [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        kmask = kk < K
        a = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    acc += tl.load(b_ptr + rn, mask=nmask, other=0.0)[None, :]
    if GELU:  # the exact (erf) GELU, as torch's default
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    omask = mmask[:, None] & nmask[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if RESIDUAL:
        acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
        acc += tl.load(r_ptr + offs, mask=omask, other=0.0).to(tl.float32)
    if SATURATE:
        acc = tl.clamp(acc, -FP16_MAX, FP16_MAX)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=omask)


LINEAR_TILES = {
    torch.float32: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
}
"""The GEMM's tile and launch settings by operand dtype, from a sweep over the Decoder's and Vocos's four shapes
on an H100 (docs/perf/engine.md): float16's is the best on three of them and within 4% on the fourth,
float32's the best on two; bfloat16 (not swept) takes float16's."""


def linear_triton(x: Tensor, weight: Tensor, bias: Tensor, gelu: bool, scale: Tensor | None,
                  residual: Tensor | None, out_dtype: torch.dtype, precision: str, tile: dict | None) -> Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    tile = LINEAR_TILES[x.dtype] if tile is None else tile
    grid = (triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]),)
    has_res = residual is not None
    _linear_kernel[grid](x, weight, bias, scale if has_res else bias, residual if has_res else x, out, m, n, k,
                         GELU=gelu, RESIDUAL=has_res, PRECISION=precision, SATURATE=out_dtype == torch.float16,
                         **tile)
    return out
