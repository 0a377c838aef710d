"""The CPU engine's decode step: the torch references' maths, bit for bit, in fewer ops.

At the tiny model's sizes (2 layers, hidden 64) a CPU decode step is all per-op overhead, so what every layer
would recompute is computed once per step (``DecodeContext``: the rotary angles, the padding mask), each layer's
K/V is gathered from the paged cache once per window (``DecodeWindow.kv``), q and k rotate in one pass, constants are tensors (a Python scalar costs an op a wrapper), and
nothing is checked: the engine builds every argument itself. ``chattts-velocity bench --size tiny --device cpu
--batch 1 8`` measures it against the reference path; ``tests/test_kernels.py`` holds it equal to the
references.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .activation import silu_and_mul_ref
from .attention import repeat_heads
from .linear import CpuWeight


@dataclass
class DecodeContext:
    """What every layer of one decode step shares. N tokens (one per sequence), T = the longest context."""

    cos: Tensor  # [N, 1, D] float32: [cos, cos] of the rotary angles
    sin: Tensor  # [N, 1, D] float32: [-sin, sin]
    store_slots: Tensor  # [M] int64: cache slots of the tokens that write K/V
    store_rows: Tensor | None  # [M] int64: which tokens those are; None: all N, in order
    masked: Tensor | None  # [N, 1, T] bool: past the sequence's context; None: every position is in context
    context: int  # T
    scale: Tensor  # [] float32: the softmax scale
    window: DecodeWindow  # holds each layer's K/V of the window's sequences (``DecodeWindow.kv``)
    step: int  # which of the window's steps this is


def linear_cpu(x: Tensor, weight: Tensor | CpuWeight, *, norm_weight: Tensor | None = None,
               eps: Tensor | None = None, residual: Tensor | None = None,
               gated: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``fused_linear_ref``, unchecked; ``eps`` a [] float32 tensor; a ``CpuWeight`` multiplies with its kernel."""
    h, r = x, None
    if norm_weight is not None:
        h = rms_norm_cpu(x, norm_weight, eps, residual)
        if residual is not None:
            h, r = h
    if isinstance(weight, CpuWeight):
        y = weight(h)  # [M, N]
    else:
        y = F.linear(h, weight)  # [M, N]: matmul(h, weight.t()), as the reference's h @ weight.T
    if gated:
        y = silu_and_mul_ref(y)
    return y if r is None else (y, r)


def rms_norm_cpu(x: Tensor, weight: Tensor, eps: Tensor,
                 residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """``rms_norm_ref``, its ops spelt as torch runs them (mean is a sum divided in place, pow(2) a product),
    with the constants as tensors; ``eps`` a [] float32 tensor."""
    r = x if residual is None else x + residual  # [N, H]
    h = r.float()
    mean_square = (h * h).sum(-1, keepdim=True).div_(_count(h.size(-1)))
    out = weight * (h * torch.rsqrt(mean_square.add_(eps))).to(x.dtype)
    return out if residual is None else (out, r)


@functools.cache
def _count(n: int) -> Tensor:
    return torch.tensor(float(n))


DENSE_KV_BYTES = 512 << 20
"""Most bytes of dense K/V copies one CPU decode window keeps (``DecodeWindow.kv``): they hold every sequence
padded to the longest context, so a large batch beside one long sequence could otherwise take many times the
paged cache's own size; the layers past it gather their cache rows at every step instead, as before."""


class DecodeWindow:
    """The contexts of K consecutive decode steps of the same N sequences (one step: K = 1). Their block tables
    do not change between the steps, so the rotary angles of all steps are one gather, and each layer's K/V of
    the window's sequences are gathered from the paged cache once, at the layer's first step, into a dense
    [N, Hk, T, D] copy (``kv``) that every step extends by its new token and attends over without another
    gather (before, each layer of each step gathered its [N * T] cache rows); the attention matmuls read the
    dense copy without a transposing copy too, several times faster at full size."""

    def __init__(self, positions: list[list[int]], slots: list[list[int]], block_tables: Tensor,
                 cos_sin_cache: Tensor, block_size: int, scale: float):
        """``positions[j][i]``: where sequence i's token of step j sits (its context is that + 1);
        ``slots[j][i]``: the cache slot it writes its K/V to (negative: no write); ``block_tables`` [N,
        max_blocks] int32."""
        self.positions, self.slots = positions, slots
        half, longest = cos_sin_cache.shape[1] // 2, max(map(max, positions)) + 1
        self.t = torch.arange(longest)  # [T]
        table = block_tables[:, : -(-longest // block_size)].long().clamp(min=0)  # unused entries may be -1
        self.gather = table[:, self.t // block_size] * block_size + self.t % block_size  # [N, T]: any slot past
        self.position_t = torch.tensor(positions)  # [K, N]
        cos, sin = cos_sin_cache[self.position_t, None].split(half, -1)  # [K, N, 1, D/2] each
        self.cos, self.sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # [K, N, 1, D] each
        self.store_slots = torch.tensor(slots, dtype=torch.int64)  # [K, N]
        self.scale = torch.tensor(scale, dtype=torch.float32)
        self._kv: dict[int, tuple[Tensor, Tensor]] = {}  # id(k_cache) -> the layer's dense K and V
        self._kept = 0  # their bytes
        self._writes: dict[tuple[int, int], Tensor] = {}  # (step, Hk) -> rows of the dense copies it writes

    def context(self, j: int) -> DecodeContext:
        """Step ``j``'s."""
        positions, slots = self.positions[j], self.slots[j]
        longest = max(positions) + 1
        store_slots, store_rows = self.store_slots[j], None
        if min(slots) < 0:
            kept = [i for i, s in enumerate(slots) if s >= 0]
            store_slots = torch.tensor([slots[i] for i in kept], dtype=torch.int64)
            store_rows = torch.tensor(kept, dtype=torch.int64)
        masked = None
        if min(positions) + 1 < longest:
            masked = (self.t[None, :longest] > self.position_t[j, :, None])[:, None]  # [N, 1, T]
        return DecodeContext(cos=self.cos[j], sin=self.sin[j], store_slots=store_slots, store_rows=store_rows,
                             masked=masked, context=longest, scale=self.scale, window=self, step=j)

    def kv(self, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's dense K and V [N, Hk, T, D] float32 (T: the window's longest context): its cache's rows
        at the layer's first step of the window, then kept up to date by ``store``. Copies are kept while all
        of the window's fit in ``DENSE_KV_BYTES``; a layer past that is gathered again at every step."""
        pair = self._kv.get(id(k_cache))
        if pair is None:
            n, t = self.gather.shape
            kv_heads, head_dim = k_cache.shape[2:]
            pair = tuple(c.view(-1, kv_heads, head_dim).index_select(0, self.gather.view(-1)).view(n, t, kv_heads, head_dim)
                         .transpose(1, 2).float().contiguous() for c in (k_cache, v_cache))
            if self._fits(k_cache):
                self._kv[id(k_cache)] = pair
                self._kept += self._bytes(k_cache)
        return pair

    def _bytes(self, k_cache: Tensor) -> int:
        return 2 * self.gather.numel() * k_cache.shape[2] * k_cache.shape[3] * 4  # K and V, float32

    def _fits(self, k_cache: Tensor) -> bool:
        return self._kept + self._bytes(k_cache) <= DENSE_KV_BYTES

    def store(self, ctx: DecodeContext, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
        """Step ``ctx.step``'s new K and V [M, Hk, D] (of the rows that write) into the layer's dense copies
        (none for a layer gathered at every step: its cache has them)."""
        if id(k_cache) not in self._kv and not self._fits(k_cache):
            return
        dense_k, dense_v = self.kv(k_cache, v_cache)
        n, kv_heads, t, head_dim = dense_k.shape
        rows = self._writes.get((ctx.step, kv_heads))
        if rows is None:  # [M * Hk]: row (i * Hk + h) * T + position of [N * Hk * T, D]
            seqs = torch.arange(n) if ctx.store_rows is None else ctx.store_rows
            rows = ((seqs * kv_heads)[:, None] + torch.arange(kv_heads)) * t + self.position_t[ctx.step, seqs, None]
            rows = self._writes[ctx.step, kv_heads] = rows.view(-1)
        dense_k.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).float())
        dense_v.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).float())


def rotary_store_kv_cpu(qkv: Tensor, num_heads: int, num_kv_heads: int, ctx: DecodeContext, k_cache: Tensor,
                        v_cache: Tensor) -> Tensor:
    """qkv [N, (Hq + 2 Hk) * D] -> rotated q [N, Hq, D]; the rotated k and v go to the caches (as
    ``rotary_store_kv_ref``; q and k rotate together, being adjacent in qkv) and to the window's dense copies."""
    n, head_dim = qkv.size(0), k_cache.size(3)
    qk, v = qkv.view(n, -1, head_dim).split([num_heads + num_kv_heads, num_kv_heads], 1)  # [N, Hq + Hk | Hk, D]
    # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] as qk * [cos, cos] + [x2, x1] * [-sin, sin]: a + (-b) is
    # a - b exactly, so the bits are the reference's
    qk = qk.float()
    rotated = (qk * ctx.cos + qk.roll(head_dim // 2, -1) * ctx.sin).to(qkv.dtype)
    q, k = rotated.split([num_heads, num_kv_heads], 1)
    if ctx.store_rows is not None:
        k, v = k[ctx.store_rows], v[ctx.store_rows]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, ctx.store_slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, ctx.store_slots, v)
    # the dense copies take what the cache holds (k and v are in its dtype); a row past its limit writes neither
    ctx.window.store(ctx, k, v, k_cache, v_cache)
    return q


def decode_attention_cpu(q: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: DecodeContext) -> Tensor:
    """q [N, Hq, D] -> out [N, Hq, D], as ``paged_decode_attention_ref`` (every context non-empty), over the
    window's dense copies of the layer's K/V (``DecodeWindow.kv``)."""
    num_heads = q.size(1)
    k, v = (repeat_heads(x[:, :, : ctx.context], num_heads, dim=1) for x in ctx.window.kv(k_cache, v_cache))
    scores = torch.matmul(q.float().unsqueeze(2), k.transpose(2, 3)).squeeze(2) * ctx.scale  # [N, Hq, T]
    if ctx.masked is not None:
        scores = scores.masked_fill(ctx.masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # as the reference, where a score overflowed
    return torch.matmul(probs.unsqueeze(2), v).squeeze(2).to(q.dtype)  # [N, Hq, D]

