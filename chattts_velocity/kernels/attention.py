"""Attention over the paged KV cache: decode (one query per sequence) and varlen causal prefill.

K/V are read through ``block_tables`` [S, max_blocks] int32: token t of sequence s sits in cache slot
block_tables[s, t // block_size] * block_size + t % block_size. Entries past a sequence's context are never
read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import (
    FLOAT_DTYPES,
    check,
    check_contiguous,
    check_rows,
    check_same_device,
    check_tensor,
    use_triton,
)
from .kv_cache import check_kv_cache


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, scale: float, *, num_splits: int | None = None,
                           split_counters: Tensor | None = None) -> Tensor:
    """q [B, Hq, D] (each sequence's newest token, its K/V already cached) -> out [B, Hq, D] in q's dtype.

    Sequence b attends to its first context_lens[b] cached tokens (a length of 0 gives zeros; it must not
    exceed block_tables.shape[1] * block_size). ``num_splits`` splits the contexts into that many ranges merged
    afterwards (flash-decoding); None picks it from the device's SM count. Query head h reads KV head
    h // (Hq // Hk). ``split_counters``: the caller's int32 zeros, at least one per (sequence, q head), with
    which a split context merges in the splitting kernel (a launch fewer); they are zeros again after each
    call, so one buffer serves every call on one stream, not calls that run at once.
    """
    _check_common(q, k_cache, v_cache, block_tables, context_lens)
    check(block_tables.shape[0] == q.shape[0] == context_lens.shape[0],
          f"batch sizes differ: q {q.shape[0]}, block_tables {block_tables.shape[0]}, "
          f"context_lens {context_lens.shape[0]}")
    check(num_splits is None or (isinstance(num_splits, int) and num_splits >= 1),
          f"num_splits must be None or an int >= 1, got {num_splits!r}")
    if split_counters is not None:
        check_tensor("split_counters", split_counters, "[>= B * Hq]", 1, (torch.int32,))
        check_contiguous("split_counters", split_counters)
        check_same_device(q=q, split_counters=split_counters)
        check(split_counters.numel() >= q.shape[0] * q.shape[1],
              f"split_counters holds {split_counters.numel()} counters, fewer than the {q.shape[0] * q.shape[1]} "
              "(sequence, head) pairs")
    if use_triton(q):
        from ._triton.decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                             num_splits, split_counters)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                            cu_seqlens_q: Tensor, context_lens: Tensor, scale: float) -> Tensor:
    """q [N, Hq, D]: the new tokens of S sequences, flattened -> out [N, Hq, D] in q's dtype, causal.

    Sequence s owns q rows cu_seqlens_q[s]:cu_seqlens_q[s + 1] (q_len of them) and has context_lens[s] cached
    tokens including those new ones, so its query i sits at position context_len - q_len + i and attends to
    cached tokens 0..that position.
    """
    _check_common(q, k_cache, v_cache, block_tables, context_lens)
    check_tensor("cu_seqlens_q", cu_seqlens_q, "[S + 1]", 1, (torch.int32,))
    check_contiguous("cu_seqlens_q", cu_seqlens_q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    check(block_tables.shape[0] == num_seqs == context_lens.shape[0],
          f"sequence counts differ: cu_seqlens_q gives {num_seqs}, block_tables {block_tables.shape[0]}, "
          f"context_lens {context_lens.shape[0]}")
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    if use_triton(q):
        from ._triton.prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                              scale)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)


def paged_decode_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                               context_lens: Tensor, scale: float) -> Tensor:
    """Torch reference of ``paged_decode_attention`` (the CPU path): the whole batch in one masked softmax
    over its longest context (a per-sequence loop made the CPU engine's step much slower)."""
    batch, num_heads, _ = q.shape
    if batch == 0:
        return torch.empty_like(q)
    slots, visible = _decode_slots(block_tables, context_lens, k_cache.shape[1])  # [B, T] each
    # [B, Hq, T, D]: each head's rows contiguous, so the matmuls read K transposed without copying it (the CPU
    # decode step's dense copies have this layout: its results are these, bit for bit)
    k, v = (repeat_heads(c.flatten(0, 1)[slots], num_heads).transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    scores = torch.matmul(q.float()[:, :, None, :], k.transpose(2, 3))[:, :, 0] * scale  # [B, Hq, T]
    probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
    out = torch.matmul(probs.nan_to_num(0.0)[:, :, None, :], v)[:, :, 0]  # empty context: zeros
    return out.to(q.dtype)


def _decode_slots(block_tables: Tensor, context_lens: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Cache slots [B, T] of every sequence's first T = max(context_lens) tokens, and which are in context."""
    batch, longest = block_tables.shape[0], max(int(context_lens.max()), 1)
    t = torch.arange(longest, device=block_tables.device)  # [T]
    table = block_tables[:, : -(-longest // block_size)].long().clamp(min=0)  # unused entries may be -1
    slots = table.gather(1, (t // block_size)[None].expand(batch, -1)) * block_size + t % block_size
    return slots, t[None, :] < context_lens[:, None].long()


def paged_prefill_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                cu_seqlens_q: Tensor, context_lens: Tensor, scale: float) -> Tensor:
    """Torch reference of ``paged_prefill_attention`` (the CPU path)."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        k, v = _gather_kv(k_cache, block_tables[s], ctx), _gather_kv(v_cache, block_tables[s], ctx)
        out[cu[s] : cu[s + 1]] = _causal_attention(q[cu[s] : cu[s + 1]], k, v, scale)
    return out


def _gather_kv(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    """The first ``length`` tokens of one sequence from a paged cache -> [length, Hk, D]."""
    block_size = cache.shape[1]
    t = torch.arange(length, device=cache.device)
    slots = block_table[t // block_size].long() * block_size + t % block_size  # [length]
    return cache.flatten(0, 1)[slots]


def repeat_heads(x: Tensor, num_heads: int, dim: int = -2) -> Tensor:
    """Heads along ``dim`` (default: [..., Hk, D]) from Hk to Hq, float32: each KV head repeated for its group
    of query heads."""
    group = num_heads // x.shape[dim]
    return (x if group == 1 else x.repeat_interleave(group, dim=dim)).float()


def _causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q [L, Hq, D] are the last L of the T positions of k, v [T, Hk, D] -> [L, Hq, D]; float32 softmax."""
    k, v = repeat_heads(k, q.shape[1]), repeat_heads(v, q.shape[1])  # [T, Hq, D]
    scores = torch.einsum("lhd,thd->hlt", q.float(), k) * scale  # [Hq, L, T]
    length, total = q.shape[0], k.shape[0]
    q_pos = torch.arange(total - length, total, device=q.device)  # [L]
    visible = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]  # [L, T]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hlt,thd->lhd", probs, v).to(q.dtype)


def _check_common(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                  context_lens: Tensor) -> None:
    check_kv_cache(k_cache, v_cache)
    check_tensor("q", q, "[N, Hq, D]", 3, FLOAT_DTYPES)
    check(q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    check_rows("q", q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    check(q.shape[1] % num_kv_heads == 0,
          f"q heads ({q.shape[1]}) must be a multiple of KV heads ({num_kv_heads})")
    check(head_dim >= 16, f"head_dim must be >= 16 (tensor-core tile), got {head_dim}")
    check_tensor("block_tables", block_tables, "[S, max_blocks]", 2, (torch.int32,))
    check_rows("block_tables", block_tables)
    check_tensor("context_lens", context_lens, "[S]", 1, (torch.int32,))
    check_contiguous("context_lens", context_lens)
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens)
