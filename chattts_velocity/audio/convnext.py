"""The ConvNeXt stacks of the wav decode (ChatTTS's Decoder/DVAE conv stack, Vocos's backbone) on the fused
channels-last kernels of ``kernels.convnext``, where they apply: float32 activations on CUDA while TF32 is on
(the wav decode's default, ``AudioDecoder(tf32=True)``) and no autograd. Elsewhere (the CPU, strict float32 as
the reference path runs, training) the modules' own torch ops run. ``CHATTTS_VELOCITY_FUSED_DECODE=0`` keeps the
modules' ops on CUDA too (``fused_default``).

Same maths as upstream's block, with the residual stream and every sum in float32 but the block's normed
input and its 4x-wide hidden activations stored in float16 and multiplied on float16 tensor cores (float16 has
TF32's 10-bit mantissa; the normed values are bounded, and a hidden value past float16's range would
saturate rather than overflow): the wavs agree with the torch ops in TF32 to its precision, not bit for bit
(`benchmarks/wav_decode.py` reports the SNR of each against strict float32).
"""

from __future__ import annotations

import os
import threading

import torch
from torch import Tensor, nn

from ..kernels.convnext import dwconv_norm, linear, time_mask


def fused_default() -> bool:
    """Whether the fused stack is on where it applies: yes, unless ``CHATTTS_VELOCITY_FUSED_DECODE=0``
    (``1`` or unset: on). A server once hung its GPU with it beside the engine's windows; the cause was the
    cuBLAS workspace that the decode's CUDA graphs shared with the engine's, not these kernels
    (``audio.graphs.DecodeGraphs.capture_stream``; docs/perf/serve.md)."""
    return os.environ.get("CHATTTS_VELOCITY_FUSED_DECODE", "") != "0"


def fused_applies(x: Tensor) -> bool:
    """Whether the fused channels-last stack runs for activations ``x`` (see the module's docstring)."""
    return (x.is_cuda and x.dtype == torch.float32 and not torch.is_grad_enabled()
            and torch.backends.cuda.matmul.fp32_precision == "tf32" and fused_default())


_COPYING = threading.Lock()


def operand_weight(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` in ``dtype``, copied once and kept while the parameter lives; an in-place change of the
    parameter (``load_state_dict``) is copied into the same tensor at the next call, so a CUDA graph that
    reads the copy (it holds no reference of its own) sees it and never outlives it. A parameter given new
    memory (``module.to`` assigning its ``.data``) gets a new copy."""
    if weight.dtype == dtype:
        return weight
    with _COPYING:  # threads decoding at once must not each make (and drop) a copy
        copies = weight.__dict__.setdefault("_operand_copies", {})  # dtype -> (memory, version, copy)
        memory, version, copy = copies.get(dtype, (None, None, None))
        now = None if weight.is_inference() else weight._version  # an inference tensor has no version
        if copy is None or memory != (weight.device, weight.data_ptr()):
            copy = weight.detach().to(dtype)
        elif version != now:
            copy.copy_(weight.detach())
        copies[dtype] = (weight.device, weight.data_ptr()), now, copy
        return copy


OPERANDS = torch.float16
"""What a block's normed and hidden activations are stored and multiplied in, unless a call says (float32:
on TF32 tensor cores)."""


def mask_frames(x: Tensor, lengths: Tensor | None) -> Tensor:
    """x [B, C, T] with row b's frames from ``lengths[b]`` on set to zero (None: ``x`` itself): what a
    convolution over T must read there for a row of a padded batch to come out as it does alone."""
    return x if lengths is None else x.masked_fill(~time_mask(lengths, x.shape[2])[:, None, :], 0.0)


def convnext_block(x: Tensor, dwconv: nn.Conv1d, norm: nn.LayerNorm, pwconv1: nn.Linear, pwconv2: nn.Linear,
                   scale: Tensor | None, dtype: torch.dtype | None = None, lengths: Tensor | None = None) -> Tensor:
    """One residual block on channels-last x [B, T, C] float32 -> [B, T, C]: ``x + scale * pwconv2(gelu(
    pwconv1(norm(dwconv(x)))))``, its activations in ``dtype`` (None: ``OPERANDS``); ``lengths`` [B] int32: each
    row's own length (``kernels.convnext.dwconv_norm``)."""
    b, t, c = x.shape
    dtype = OPERANDS if dtype is None else dtype
    w1, w2 = operand_weight(pwconv1.weight, dtype), operand_weight(pwconv2.weight, dtype)
    scale = torch.ones_like(pwconv2.bias) if scale is None else scale
    y = dwconv_norm(x, dwconv.weight, dwconv.bias, dwconv.dilation[0], dwconv.padding[0], norm.weight, norm.bias,
                    norm.eps, out_dtype=dtype, lengths=lengths)  # [B, T, C]
    h = linear(y.view(b * t, c), w1, pwconv1.bias, gelu=True, out_dtype=dtype)  # [B*T, 4C]
    return linear(h, w2, pwconv2.bias, scale=scale, residual=x.view(b * t, c)).view(b, t, c)


def conv_stack(stack, x: Tensor, dtype: torch.dtype | None = None, lengths: Tensor | None = None) -> Tensor:
    """``audio.dvae.ConvStack``'s forward [B, idim, T] -> [B, odim, T] on the fused blocks (``x`` after its
    ``conv_in``; the result a transposed view); ``dtype`` and ``lengths`` as ``convnext_block``'s."""
    h = x.transpose(1, 2).contiguous()  # [B, T, hidden]
    for block in stack.decoder_block:
        h = convnext_block(h, block.dwconv, block.norm, block.pwconv1, block.pwconv2, block.weight, dtype, lengths)
    return torch.matmul(h, stack.conv_out.weight[:, :, 0].t()).transpose(1, 2)  # the 1x1 conv: [B, odim, T]


def vocos_backbone(backbone, mel: Tensor, fused: bool | None = None, dtype: torch.dtype | None = None,
                   lengths: Tensor | None = None) -> Tensor:
    """Vocos's ``VocosBackbone`` forward, mel [B, n_mels, F] -> features [B, F, dim], on the fused blocks where
    they apply (``fused``: force, or None for ``fused_applies``; never with an AdaLayerNorm, which ChatTTS's
    Vocos does not have); ``dtype`` as ``convnext_block``'s; ``lengths`` [B] int32: each row's own number of
    frames, those after it read as zeros by every convolution."""
    if fused is None:
        fused = fused_applies(mel)
    adanorm = backbone.adanorm or any(block.adanorm for block in backbone.convnext)
    if adanorm and lengths is not None:
        raise ValueError("rows of their own lengths need a backbone without AdaLayerNorm")
    mel = mask_frames(mel, lengths)
    if adanorm or (not fused and lengths is None):
        return backbone(mel)
    x = backbone.norm(backbone.embed(mel).transpose(1, 2))  # [B, F, dim]
    if not fused:  # the modules' ops, each convolution's input masked
        x = x.transpose(1, 2)
        for block in backbone.convnext:
            x = block(mask_frames(x, lengths))
        return backbone.final_layer_norm(x.transpose(1, 2))
    x = x.contiguous()
    for block in backbone.convnext:
        x = convnext_block(x, block.dwconv, block.norm, block.pwconv1, block.pwconv2, block.gamma, dtype, lengths)
    return backbone.final_layer_norm(x)
