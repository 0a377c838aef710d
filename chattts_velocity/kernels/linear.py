"""Linear layers of the decode step with their neighbours fused in: an optional residual add + RMSNorm in
front (the Llama layer's input and post-attention norms) and an optional SwiGLU gate behind (gate/up); the
q/k/v projection also with the rotary embedding and the KV-cache write behind it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._dispatch import FLOAT_DTYPES, check, check_contiguous, check_same_device, check_tensor, use_triton
from .activation import silu_and_mul_ref
from .kv_cache import check_store_kv
from .norm import rms_norm_ref
from .rotary import check_rotary, rotary_store_kv, rotary_store_kv_ref

MAX_FUSED_ROWS = 16
"""Up to this many rows one Triton program reads each weight tile once for all rows (a small decode batch).
Larger batches run the unfused ops, which the fused kernel beats only at small batches
(`benchmarks/kernel_probe.py`; docs/perf/)."""


def fused_linear(x: Tensor, weight: Tensor, *, norm_weight: Tensor | None = None, eps: float = 1e-6,
                 residual: Tensor | None = None, gated: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """x [M, K] -> y = h @ weight.T, where h = x, or with ``norm_weight`` h = rms_norm(r) * norm_weight with
    r = x (+ ``residual``). ``gated``: weight is cat(gate, up) [2I, K] and y = silu(h @ gate.T) * (h @ up.T)
    [M, I]. Returns y, or (y, r) when a residual is given. Every op rounds to x's dtype where the unfused
    ops do, so both agree up to float32 summation order."""
    _check(x, weight, norm_weight, residual, gated)
    if not use_triton(x):
        return _unfused(x, weight, norm_weight, eps, residual, gated, rms_norm_ref, silu_and_mul_ref)
    if x.shape[0] == 1:
        from ._triton.gemv import gemv_triton

        return gemv_triton(x, weight, norm_weight, eps, residual, gated)
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
    ``slot_mapping``). Returns (qkv, the new residual, or None without one). One Triton launch for one row
    (a batch-1 decode step); a launch for the linear and one for the rotation and the write otherwise."""
    if x.shape[0] == 1 and use_triton(x):
        _check(x, weight, norm_weight, residual, False)
        qkv = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
        q, k, v = _qkv_views(qkv, cos_sin_cache, num_heads, num_kv_heads)
        check_rotary(q, k, positions, cos_sin_cache)  # the checks ``rotary_store_kv`` makes, on the output's views
        check_store_kv(k, v, k_cache, v_cache, slot_mapping)
        from ._triton.gemv import gemv_triton

        out = gemv_triton(x, weight, norm_weight, eps, residual, False,
                          (positions, cos_sin_cache, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads), out=qkv)
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
    y = h @ weight.T  # [M, N]
    if gated:
        y = gate(y)
    return y if r is None else (y, r)


def _check(x: Tensor, weight: Tensor, norm_weight: Tensor | None, residual: Tensor | None, gated: bool) -> None:
    check_tensor("x", x, "[M, K]", 2, FLOAT_DTYPES)
    check_contiguous("x", x)
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
    optional = {"norm_weight": norm_weight, "residual": residual}
    check_same_device(x=x, weight=weight, **{k: v for k, v in optional.items() if v is not None})
