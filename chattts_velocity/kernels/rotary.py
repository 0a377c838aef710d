"""Rotary position embedding, non-interleaved (Hugging Face ``rotate_half``) convention, applied in place;
also fused with the KV-cache write that follows it in every layer."""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_contiguous,
    check_rows,
    check_same_device,
    check_tensor,
    is_power_of_two,
    use_triton,
)
from .kv_cache import check_store_kv, store_kv_ref


def rotary_cos_sin_cache(head_dim: int, max_pos: int, theta: float, device: torch.device | str) -> Tensor:
    """[max_pos, head_dim] float32: cos(pos * inv_freq) in the first half of each row, sin in the second.

    Computed as Hugging Face Llama's default rope does: inv_freq in float32 on the CPU, then the angles and
    their cos/sin on ``device``, so the values match the model's bit for bit.
    """
    check(head_dim > 0 and head_dim % 2 == 0, f"head_dim must be even and > 0, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [D/2]
    pos = torch.arange(max_pos, device=device, dtype=torch.float)  # [P]
    freqs = pos[:, None] * inv_freq.to(device)[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate q [N, Hq, D] and k [N, Hk, D] in place by the angles of ``positions`` [N]; returns (q, k).

    q and k may be strided views (e.g. slices of a fused qkv) as long as each head's D values are contiguous.
    Positions must be < cos_sin_cache.shape[0] (not checked: that would sync with the GPU).
    """
    check_rotary(q, k, positions, cos_sin_cache)
    if use_triton(q):
        from ._triton.rotary import apply_rotary_triton

        apply_rotary_triton(q, k, positions, cos_sin_cache)
    else:
        apply_rotary_ref(q, k, positions, cos_sin_cache)
    return q, k


def apply_rotary_ref(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Torch reference of ``apply_rotary`` (the CPU path): float32 maths, in place."""
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()]  # [N, D]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]  # [N, 1, D/2]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
    return q, k


def rotary_store_kv(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, k_cache: Tensor,
                    v_cache: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rotary`` then ``store_kv`` in one launch; returns (q, k), rotated in place.

    q [N, Hq, D], k and v [N, Hk, D] (strided views allowed, heads contiguous in D); the rotated k and v go to
    k_cache, v_cache [num_blocks, block_size, Hk, D] at ``slot_mapping`` [N] (a negative slot skips the write,
    not the rotation).
    """
    check_rotary(q, k, positions, cos_sin_cache)
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    if use_triton(q):
        from ._triton.rotary_store_kv import rotary_store_kv_triton

        rotary_store_kv_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    else:
        rotary_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return q, k


def rotary_store_kv_ref(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                        k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """Torch reference of ``rotary_store_kv`` (the CPU path)."""
    apply_rotary_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def check_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> None:
    check_tensor("q", q, "[N, Hq, D]", 3, FLOAT_DTYPES)
    check_tensor("k", k, "[N, Hk, D]", 3, (q.dtype,))
    n, _, head_dim = q.shape
    check(k.shape[0] == n and k.shape[2] == head_dim,
          f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in N or D")
    check(is_power_of_two(head_dim) and head_dim >= 2,
          f"head_dim must be a power of two >= 2, got {head_dim}")
    check_rows("q", q)
    check_rows("k", k)
    check_tensor("positions", positions, "[N]", 1, INDEX_DTYPES)
    check(positions.shape[0] == n, f"positions has {positions.shape[0]} entries, q has {n} tokens")
    check_contiguous("positions", positions)
    check_tensor("cos_sin_cache", cos_sin_cache, "[max_pos, D]", 2, (torch.float32,))
    check(cos_sin_cache.shape[1] == head_dim, f"cos_sin_cache rows have {cos_sin_cache.shape[1]} values, "
                                              f"head_dim is {head_dim}")
    check_contiguous("cos_sin_cache", cos_sin_cache)
    check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
