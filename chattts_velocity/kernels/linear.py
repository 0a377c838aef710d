"""Linear layers of the decode step with their neighbours fused in: an optional residual add + RMSNorm in
front (the Llama layer's input and post-attention norms) and an optional SwiGLU gate behind (gate/up); the
q/k/v projection also with the rotary embedding and the KV-cache write behind it. On the CPU a weight may be
a ``CpuWeight`` (bfloat16 or int8, stored the way its CPU kernel reads it)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cpu_threads import on_own_thread
from ._dispatch import FLOAT_DTYPES, check, check_contiguous, check_same_device, check_tensor, use_triton
from .activation import silu_and_mul_ref
from .kv_cache import check_store_kv
from .norm import rms_norm_ref
from .rotary import check_rotary, rotary_store_kv, rotary_store_kv_ref

MAX_FUSED_ROWS = 16
"""Up to this many rows one Triton program reads each weight tile once for all rows (a small decode batch).
Larger batches run the unfused ops, which the fused kernel beats only at small batches
(`benchmarks/kernel_probe.py`; docs/perf/)."""


PREFETCH_ROWS = 8
"""Decode steps of up to this many rows run kernels that load their weights before they wait for their input
(under programmatic dependent launch, while the kernel before them runs): the one-row GEMV, over each row in
turn while the rows are few (``GEMV_ROWS``; ``GEMV_ROWS_LONG_K`` for rows longer than the output, as the down
projection's), else the prefetching tensor-core GEMM, except for long rows, which go back to the skinny GEMM.
The fastest per role at each batch of `benchmarks/kernel_probe.py --parts prefetch`; the limit is where the
engine's step stopped gaining (docs/perf/engine.md)."""
GEMV_ROWS = 2
GEMV_ROWS_LONG_K = 8


@functools.cache
def prefetch_rows() -> int:
    """``PREFETCH_ROWS``, or ``CHATTTS_VELOCITY_PREFETCH_ROWS`` (0 or 1: from 2 rows the skinny GEMM and the
    unfused ops as before; for comparisons)."""
    from ._triton.prefetch_linear import MAX_PREFETCH_ROWS

    rows = int(os.environ.get("CHATTTS_VELOCITY_PREFETCH_ROWS", PREFETCH_ROWS))
    check(0 <= rows <= MAX_PREFETCH_ROWS, f"CHATTTS_VELOCITY_PREFETCH_ROWS must be 0 to {MAX_PREFETCH_ROWS}, "
          f"got {rows}")
    return rows


def _fetching_kernel(x: Tensor, n: int, k: int) -> Callable | None:
    """The kernel that loads its weights first for x [M, K] times [N, K] weights, or None."""
    m = x.shape[0]
    if m > 1 and (m > prefetch_rows() or (x.is_cuda and x.dtype == torch.float32)):  # (float32 tiles would
        return None                                                                  # overflow shared memory)
    long_k = k > n
    if m <= (GEMV_ROWS_LONG_K if long_k else GEMV_ROWS):
        from ._triton.gemv import gemv_triton

        return gemv_triton
    if long_k:
        return None
    from ._triton.prefetch_linear import prefetch_linear_triton

    return prefetch_linear_triton


CPU_WEIGHT_FORMATS = ("float16", "bfloat16", "int8")
"""The formats a ``CpuWeight`` stores."""
INT8_K_MULTIPLE = 32
"""torch's int8 weight-packed CPU GEMM reads the inputs 32 at a time and returns garbage for other widths."""


class CpuWeight:
    """A linear layer's weight [N, K] stored for a CPU kernel that streams fewer bytes than the float32 matrix (a
    CPU decode step is bound by reading its weights), prepacked once:

    - ``float16``: fbgemm's float16 GEMM, which converts the weights and multiplies in float32 (float32
      activations in and out);
    - ``bfloat16``: oneDNN's bfloat16 GEMM (activations rounded to bfloat16, a bfloat16 result);
    - ``int8``: one scale per output row (the row's largest magnitude over 127), weight-only: torch's int8
      weight-packed GEMM, activations rounded to bfloat16, a bfloat16 result.

    ``weight(x)`` multiplies x [M, K] (any float dtype) and returns [M, N] in x's dtype; ``dequantized()`` is the
    float32 matrix it multiplies by, the reference's (``cpu_weight_linear_ref``). ``python
    benchmarks/cpu_speed.py --parts linears`` times each against float32 (docs/perf/cpu.md)."""

    def __init__(self, weight: Tensor, fmt: str):
        check(fmt in CPU_WEIGHT_FORMATS, f"fmt must be one of {', '.join(CPU_WEIGHT_FORMATS)}, got {fmt!r}")
        check_tensor("weight", weight, "[N, K]", 2, FLOAT_DTYPES)
        check(weight.device.type == "cpu", f"a CpuWeight lives on the CPU, got a weight on {weight.device}")
        check(fmt != "int8" or weight.shape[1] % INT8_K_MULTIPLE == 0,
              f"int8 CPU weights need a multiple of {INT8_K_MULTIPLE} inputs (torch's kernel), got [N, K] = "
              f"{list(weight.shape)}; use float16 or bfloat16")
        self.fmt, self.shape = fmt, weight.shape
        w = weight.detach().float()
        try:
            self._pack(w)
        except RuntimeError as e:  # no kernel in this build of torch (fbgemm: x86 only)
            raise ValueError(f"{fmt} CPU weights need a kernel this torch lacks on this machine ({e}); "
                             "keep the matrices in float32 (engine dtype float32)") from None

    def _pack(self, w: Tensor) -> None:
        fmt = self.fmt
        self.data: Tensor | None = None  # [N, K] int8: int8's rows (the others keep only their packed copy)
        self.scale: Tensor | None = None  # [N] bfloat16: int8's row scales
        self._packed = None
        if fmt == "float16":
            self._packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        elif fmt == "bfloat16":
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None)  # oneDNN's blocked layout
        else:
            # the kernel takes the scales in its activations' dtype; rounding them first makes the int8 rows
            # those of the scales it multiplies by
            self.scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.bfloat16).tiny).bfloat16()
            self.data = torch.round(w / self.scale.float()[:, None]).clamp(-127, 127).to(torch.int8)

    def __call__(self, x: Tensor) -> Tensor:
        if self.fmt == "float16":
            y = torch.ops.quantized.linear_dynamic_fp16(x.float(), self._packed)
        elif self.fmt == "bfloat16":
            y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self._packed, None, "none", [], "")
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.data, self.scale)
        return y.to(x.dtype)

    def size(self, dim: int) -> int:
        return self.shape[dim]

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the stored matrix."""
        return {"float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}[self.fmt]

    def dequantized(self) -> Tensor:
        """[N, K] float32: the values the kernel multiplies by, read back from the stored (packed) matrix."""
        if self.fmt == "float16":
            return torch.ops.quantized.linear_unpack_fp16(self._packed)[0]
        if self.fmt == "bfloat16":
            return self._packed.to_dense().float()
        return self.data.float() * self.scale.float()[:, None]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored matrix and its scales (what a multiply streams)."""
        scale = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.shape.numel() * self.stored_dtype.itemsize + scale


@functools.cache
def cpu_weight_formats() -> tuple[str, ...]:
    """The ``CpuWeight`` formats whose kernels this build of torch runs, and gets right, on this machine (probed
    on a thread of its own: the kernels' OpenMP team must not stay with the caller, ``cpu_threads``)."""
    return on_own_thread(torch.device("cpu"), _probe_formats)


def _probe_formats() -> tuple[str, ...]:
    w, x = torch.linspace(-1, 1, 8 * 64).view(8, 64), torch.linspace(1, -1, 2 * 64).view(2, 64)
    runs = []
    for fmt in CPU_WEIGHT_FORMATS:
        try:
            weight = CpuWeight(w, fmt)
            if torch.allclose(weight(x), cpu_weight_linear_ref(x, weight), rtol=2**-6, atol=2**-6):
                runs.append(fmt)
        except (RuntimeError, ValueError):
            continue
    return tuple(runs)


def cpu_weight_linear_ref(x: Tensor, weight: CpuWeight) -> Tensor:
    """Torch reference of ``weight(x)``: float32 products of x as the kernel takes it (float32 for float16,
    else rounded to bfloat16) with the dequantized weight; bfloat16 results are rounded as the kernels round."""
    h = x.float() if weight.fmt == "float16" else x.to(torch.bfloat16).float()
    y = F.linear(h, weight.dequantized())
    return (y if weight.fmt == "float16" else y.bfloat16()).to(x.dtype)


def fused_linear(x: Tensor, weight: Tensor, *, norm_weight: Tensor | None = None, eps: float = 1e-6,
                 residual: Tensor | None = None, gated: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """x [M, K] -> y = h @ weight.T, where h = x, or with ``norm_weight`` h = rms_norm(r) * norm_weight with
    r = x (+ ``residual``). ``gated``: weight is cat(gate, up) [2I, K] and y = silu(h @ gate.T) * (h @ up.T)
    [M, I]. Returns y, or (y, r) when a residual is given. Every op rounds to x's dtype where the unfused
    ops do, so both agree up to float32 summation order. A ``CpuWeight`` runs its own kernel, unfused."""
    _check(x, weight, norm_weight, residual, gated)
    if isinstance(weight, CpuWeight) or not use_triton(x):
        return _unfused(x, weight, norm_weight, eps, residual, gated, rms_norm_ref, silu_and_mul_ref)
    kernel = _fetching_kernel(x, weight.shape[0] // 2 if gated else weight.shape[0], x.shape[1])
    if kernel is not None:
        return kernel(x, weight, norm_weight, eps, residual, gated)
    if x.shape[0] <= MAX_FUSED_ROWS:
        from ._triton.linear import fused_linear_triton

        return fused_linear_triton(x, weight, norm_weight, eps, residual, gated)
    # the unchecked kernels: _check covered their arguments (this runs in every layer)
    from ._triton.activation import silu_and_mul_triton
    from ._triton.norm import rms_norm_triton

    return _unfused(x, weight, norm_weight, eps, residual, gated, rms_norm_triton, silu_and_mul_triton)


def fused_qkv_rotary_store(x: Tensor, weight: Tensor, *, norm_weight: Tensor, eps: float,
                           residual: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, k_cache: Tensor,
                           v_cache: Tensor, slot_mapping: Tensor, num_heads: int,
                           num_kv_heads: int) -> tuple[Tensor, Tensor | None]:
    """A layer's front: qkv = ``fused_linear(x, weight, norm_weight=..., residual=...)`` ([M, (Hq + 2 Hk) D]),
    then ``rotary_store_kv`` on its q, k, v views (q and k rotated in place, k and v written to the cache at
    ``slot_mapping``). Returns (qkv, the new residual, or None without one). One Triton launch up to
    ``PREFETCH_ROWS`` rows (a decode step); a launch for the linear and one for the rotation and the write
    otherwise."""
    kernel = None
    if use_triton(x) and not isinstance(weight, CpuWeight):
        kernel = _fetching_kernel(x, weight.shape[0], x.shape[1])
    if kernel is not None:
        _check(x, weight, norm_weight, residual, False)
        qkv = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        q, k, v = _qkv_views(qkv, cos_sin_cache, num_heads, num_kv_heads)
        check_rotary(q, k, positions, cos_sin_cache)  # the checks ``rotary_store_kv`` makes, on the output's views
        check_store_kv(k, v, k_cache, v_cache, slot_mapping)
        rope = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
        out = kernel(x, weight, norm_weight, eps, residual, False, rope, out=qkv)
        return out if residual is not None else (out, None)
    out = fused_linear(x, weight, norm_weight=norm_weight, eps=eps, residual=residual)
    qkv, new_residual = out if residual is not None else (out, None)
    rotary_store_kv(*_qkv_views(qkv, cos_sin_cache, num_heads, num_kv_heads), positions, cos_sin_cache, k_cache,
                    v_cache, slot_mapping)
    return qkv, new_residual


def fused_qkv_rotary_store_ref(x: Tensor, weight: Tensor, *, norm_weight: Tensor, eps: float,
                               residual: Tensor | None, positions: Tensor, cos_sin_cache: Tensor,
                               k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, num_heads: int,
                               num_kv_heads: int) -> tuple[Tensor, Tensor | None]:
    """Torch reference of ``fused_qkv_rotary_store``: the reference ops in turn."""
    out = fused_linear_ref(x, weight, norm_weight=norm_weight, eps=eps, residual=residual)
    qkv, new_residual = out if residual is not None else (out, None)
    rotary_store_kv_ref(*_qkv_views(qkv, cos_sin_cache, num_heads, num_kv_heads), positions, cos_sin_cache,
                        k_cache, v_cache, slot_mapping)
    return qkv, new_residual


def _qkv_views(qkv: Tensor, cos_sin_cache: Tensor, num_heads: int, num_kv_heads: int) -> tuple[Tensor, ...]:
    """q [N, Hq, D], k and v [N, Hk, D]: views of a q/k/v projection's output (head_dim D from the rotary cache)."""
    n, head_dim = qkv.shape[0], cos_sin_cache.shape[-1]
    want = (num_heads + 2 * num_kv_heads) * head_dim
    check(qkv.shape[1] == want, f"weight has {qkv.shape[1]} rows, not (num_heads + 2 num_kv_heads) * head_dim = {want}")
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)


def fused_linear_ref(x: Tensor, weight: Tensor, *, norm_weight: Tensor | None = None, eps: float = 1e-6,
                     residual: Tensor | None = None, gated: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Torch reference of ``fused_linear``: the unfused reference ops in turn."""
    _check(x, weight, norm_weight, residual, gated)
    return _unfused(x, weight, norm_weight, eps, residual, gated, rms_norm_ref, silu_and_mul_ref)


def _unfused(x: Tensor, weight: Tensor, norm_weight: Tensor | None, eps: float, residual: Tensor | None,
             gated: bool, norm: Callable, gate: Callable) -> Tensor | tuple[Tensor, Tensor]:
    h, r = x, None
    if norm_weight is not None:
        h = norm(x, norm_weight, eps, residual)
        if residual is not None:
            h, r = h
    y = weight(h) if isinstance(weight, CpuWeight) else h @ weight.T  # [M, N]
    if gated:
        y = gate(y)
    return y if r is None else (y, r)


def _check(x: Tensor, weight: Tensor, norm_weight: Tensor | None, residual: Tensor | None, gated: bool) -> None:
    check_tensor("x", x, "[M, K]", 2, FLOAT_DTYPES)
    check_contiguous("x", x)
    if isinstance(weight, CpuWeight):
        check(x.device.type == "cpu", f"a CpuWeight multiplies CPU tensors, got x on {x.device}")
    else:
        check_tensor("weight", weight, "[N, K]", 2, (x.dtype,))
        check_contiguous("weight", weight)
    check(weight.shape[1] == x.shape[1], f"weight has {weight.shape[1]} inputs, x has {x.shape[1]} features")
    check(not gated or weight.shape[0] % 2 == 0,
          f"a gated weight stacks gate and up rows, got an odd row count {weight.shape[0]}")
    check(residual is None or norm_weight is not None, "a residual is only added in front of a norm")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, "[K]", 1, (x.dtype,))
        check(norm_weight.shape[0] == x.shape[1],
              f"norm_weight has {norm_weight.shape[0]} elements, x has {x.shape[1]} features")
        check_contiguous("norm_weight", norm_weight)
    if residual is not None:
        check_tensor("residual", residual, "[M, K]", 2, (x.dtype,))
        check(residual.shape == x.shape, f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        check_contiguous("residual", residual)
    tensors = {"x": x, "weight": weight, "norm_weight": norm_weight, "residual": residual}
    check_same_device(**{k: v for k, v in tensors.items() if isinstance(v, Tensor)})
