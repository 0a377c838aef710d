"""The ConvNeXt block of the wav decode (ChatTTS's Decoder and DVAE, and Vocos's backbone), channels last.

Upstream's block is depthwise conv over time -> transpose -> LayerNorm -> Linear -> GELU -> Linear -> layer
scale -> transpose -> residual add, in torch ops: on the GPU most of its time is the transposes' copies, the
depthwise convolution's generic kernel and the elementwise passes over the 4x-wide hidden activations, not the
two GEMMs. Here the activations stay [B, T, C] (channels last) through a whole stack, and a block is three
kernels: ``dwconv_norm`` (the convolution and the LayerNorm in one pass), ``linear`` with the GELU in its
epilogue, and ``linear`` with the layer scale and the residual add in its epilogue.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dispatch import check, check_contiguous, check_same_device, check_tensor, use_triton

_FLOAT32 = (torch.float32,)
_OPERANDS = (torch.float32, torch.float16, torch.bfloat16)


def dwconv_norm(x: Tensor, conv_weight: Tensor, conv_bias: Tensor, dilation: int, padding: int,
                norm_weight: Tensor, norm_bias: Tensor, eps: float, out_dtype: torch.dtype = torch.float32,
                lengths: Tensor | None = None) -> Tensor:
    """x [B, T, C] float32 (channels last) -> ``layer_norm(conv1d(x over T, groups=C))`` [B, T, C] in
    ``out_dtype``; ``conv_weight`` [C, 1, K], ``conv_bias`` [C], zero padding of ``padding`` frames each side.
    ``lengths`` [B] int32: row b is ``lengths[b]`` frames long, its frames from there on read as zeros (so its
    first ``lengths[b]`` outputs are those of the row alone; the later ones are of no use)."""
    check_tensor("x", x, "[B, T, C]", 3, _FLOAT32)
    check_contiguous("x", x)
    c = x.shape[2]
    check_tensor("conv_weight", conv_weight, "[C, 1, K]", 3, _FLOAT32)
    check(conv_weight.shape[:2] == (c, 1), f"conv_weight must be [{c}, 1, K], got {tuple(conv_weight.shape)}")
    for name, t in (("conv_bias", conv_bias), ("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        check_tensor(name, t, "[C]", 1, _FLOAT32)
        check(t.shape[0] == c, f"{name} has {t.shape[0]} elements, x has {c} channels")
        check_contiguous(name, t)
    check_contiguous("conv_weight", conv_weight)
    check(padding == dilation * (conv_weight.shape[2] // 2), "only 'same' padding: dilation * (K // 2)")
    check(out_dtype in _OPERANDS, f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    check_same_device(x=x, conv_weight=conv_weight, norm_weight=norm_weight)
    if lengths is not None:
        check_tensor("lengths", lengths, "[B]", 1, (torch.int32,))
        check(lengths.shape[0] == x.shape[0], f"lengths has {lengths.shape[0]} elements, x has {x.shape[0]} rows")
        check_contiguous("lengths", lengths)
        check_same_device(x=x, lengths=lengths)
    if use_triton(x):
        from ._triton.convnext import dwconv_norm_triton

        return dwconv_norm_triton(x, conv_weight, conv_bias, dilation, padding, norm_weight, norm_bias, eps,
                                  out_dtype, lengths)
    return dwconv_norm_ref(x, conv_weight, conv_bias, dilation, padding, norm_weight, norm_bias, eps, out_dtype,
                           lengths)


def time_mask(lengths: Tensor, frames: int) -> Tensor:
    """[B, frames] bool: True where a frame lies within its row's length."""
    return torch.arange(frames, device=lengths.device) < lengths[:, None]


def dwconv_norm_ref(x: Tensor, conv_weight: Tensor, conv_bias: Tensor, dilation: int, padding: int,
                    norm_weight: Tensor, norm_bias: Tensor, eps: float,
                    out_dtype: torch.dtype = torch.float32, lengths: Tensor | None = None) -> Tensor:
    """Torch reference of ``dwconv_norm``: upstream's ops."""
    if lengths is not None:
        x = x.masked_fill(~time_mask(lengths, x.shape[1])[:, :, None], 0.0)
    y = F.conv1d(x.transpose(1, 2), conv_weight, conv_bias, padding=padding, dilation=dilation, groups=x.shape[2])
    return F.layer_norm(y.transpose(1, 2), (x.shape[2],), norm_weight, norm_bias, eps).to(out_dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor, *, gelu: bool = False, scale: Tensor | None = None,
           residual: Tensor | None = None, out_dtype: torch.dtype = torch.float32, tf32: bool = True,
           tile: dict | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]ᵀ + bias [N], then ``gelu`` (exact), or ``* scale [N] + residual [M, N]``
    (both or neither); accumulated in float32, stored in ``out_dtype``. float32 operands multiply on TF32
    tensor cores if ``tf32``, else in full float32; float16/bfloat16 ones (x and weight of one dtype) as they
    are. ``tile``: the Triton GEMM's tile and launch settings (default: ``LINEAR_TILES`` of the operands' dtype)."""
    check_tensor("x", x, "[M, K]", 2, _OPERANDS)
    check_contiguous("x", x)
    m, k = x.shape
    check_tensor("weight", weight, "[N, K]", 2, (x.dtype,))
    check(weight.shape[1] == k, f"weight is {tuple(weight.shape)}, x has {k} columns")
    check_contiguous("weight", weight)
    n = weight.shape[0]
    check_tensor("bias", bias, "[N]", 1, _FLOAT32)
    check(bias.shape[0] == n, f"bias has {bias.shape[0]} elements, the weight {n} rows")
    check_contiguous("bias", bias)
    check((scale is None) == (residual is None), "scale and residual come together")
    check(not (gelu and residual is not None), "gelu or scale + residual, not both")
    if residual is not None:
        check_tensor("scale", scale, "[N]", 1, _FLOAT32)
        check(scale.shape[0] == n, f"scale has {scale.shape[0]} elements, the weight {n} rows")
        check_contiguous("scale", scale)
        check_tensor("residual", residual, "[M, N]", 2, _FLOAT32)
        check(residual.shape == (m, n), f"residual must be [{m}, {n}], got {tuple(residual.shape)}")
        check_contiguous("residual", residual)
        check_same_device(x=x, scale=scale, residual=residual)
    check(out_dtype in _OPERANDS, f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    check_same_device(x=x, weight=weight, bias=bias)
    if use_triton(x):
        from ._triton.convnext import linear_triton

        return linear_triton(x, weight, bias, gelu, scale, residual, out_dtype, "tf32" if tf32 else "ieee", tile)
    return linear_ref(x, weight, bias, gelu=gelu, scale=scale, residual=residual, out_dtype=out_dtype)


def linear_ref(x: Tensor, weight: Tensor, bias: Tensor, *, gelu: bool = False, scale: Tensor | None = None,
               residual: Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """Torch reference of ``linear`` (float32 maths)."""
    y = F.linear(x.float(), weight.float(), bias)
    if gelu:
        y = F.gelu(y)
    if residual is not None:
        y = residual + y * scale
    return y.to(out_dtype)
