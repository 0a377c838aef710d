"""The Llama-core kernels against their torch references, and the references against independent maths.

Kernel vs reference runs over two case tables: on CPU through the Triton interpreter (tiny shapes, float32
and float16; all cases in one subprocess started with ``TRITON_INTERPRET=1``, because the interpreter is
chosen when ``triton.jit`` decorates a kernel and must not leak into other tests), and on CUDA with the real
model's shapes (``-m gpu``). bfloat16 is GPU-only: the interpreter rounds it differently from torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from interpreter import fix_interpreter_for_numpy_2_4, report, run_interpreter_main

from chattts_velocity import kernels as K

TOLERANCES = {  # dtype -> (atol, rtol): about two ulps of the output dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------- input helpers


def _randn(*shape: int, dtype: torch.dtype, device: str, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    """Drawn on the CPU in float32, so a case gets the same values on every device."""
    return (torch.randn(*shape) * std + mean).to(dtype=dtype, device=device)


def _heads(n: int, heads: int, head_dim: int, dtype: torch.dtype, device: str, strided: bool) -> torch.Tensor:
    """[n, heads, head_dim]; ``strided``: a slice of a wider fused projection, like q of a qkv GEMM."""
    if not strided:
        return _randn(n, heads, head_dim, dtype=dtype, device=device)
    fused = _randn(n, (heads + 3) * head_dim, dtype=dtype, device=device)  # [n, (heads + 3) D]
    return fused[:, head_dim : (heads + 1) * head_dim].view(n, heads, head_dim)


def _qkv(n: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, device: str,
         strided: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, Hq, D], k and v [n, Hk, D]; ``strided``: views of one fused qkv projection, as the model has them."""
    q_heads, kv_heads = heads
    if not strided:
        return tuple(_randn(n, h, head_dim, dtype=dtype, device=device) for h in (q_heads, kv_heads, kv_heads))
    fused = _randn(n, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)  # [n, (Hq + 2 Hk) D]
    q, k, v = fused.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return q.view(n, q_heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)


def _paged_cache(context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random k/v caches with two spare blocks, and a block table giving each sequence shuffled block ids;
    entries past a context are -1, so reading one faults or shows in the result."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    ids = torch.randperm(num_blocks).tolist()
    table = torch.full((len(context_lens), max(blocks_per_seq, default=0) + 1), -1, dtype=torch.int32)
    for s, count in enumerate(blocks_per_seq):
        table[s, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
    return k_cache, v_cache, table.to(device)


def _int32(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------- kernel vs reference, per op


def _check_rms_norm(dtype: torch.dtype, device: str, n: int, hidden: int, residual: bool) -> None:
    x = _randn(n, hidden, dtype=dtype, device=device)
    weight = _randn(hidden, dtype=dtype, device=device, std=0.1, mean=1.0)
    res = _randn(n, hidden, dtype=dtype, device=device) if residual else None
    out, expected = K.rms_norm(x, weight, 1e-6, res), K.rms_norm_ref(x, weight, 1e-6, res)
    if residual:
        assert torch.equal(out[1], expected[1]), "new residual differs"
        out, expected = out[0], expected[0]
    _assert_close(out, expected, dtype)


def _check_apply_rotary(dtype: torch.dtype, device: str, n: int, heads: tuple[int, int], head_dim: int,
                        positions_dtype: torch.dtype, strided: bool) -> None:
    cache = K.rotary_cos_sin_cache(head_dim, 4096, 10000.0, device)
    positions = torch.randint(0, 4096, (n,), dtype=positions_dtype).to(device)
    q, k = (_heads(n, h, head_dim, dtype, device, strided) for h in heads)
    q_ref, k_ref = K.apply_rotary_ref(q.clone(), k.clone(), positions, cache)
    q_out, k_out = K.apply_rotary(q, k, positions, cache)
    assert q_out is q and k_out is k, "apply_rotary must work in place"
    _assert_close(q, q_ref, dtype)
    _assert_close(k, k_ref, dtype)


def _check_silu_and_mul(dtype: torch.dtype, device: str, n: int, inter: int) -> None:
    x = _randn(n, 2 * inter, dtype=dtype, device=device, std=3.0)
    _assert_close(K.silu_and_mul(x), K.silu_and_mul_ref(x), dtype)


def _check_store_kv(dtype: torch.dtype, device: str, n: int, kv_heads: int, head_dim: int, block_size: int,
                    strided: bool) -> None:
    num_blocks = -(-n // block_size) + 2
    slots = torch.randperm(num_blocks * block_size)[:n]
    slots[::3] = -1  # padding tokens
    slots = slots.to(device)
    k, v = (_heads(n, kv_heads, head_dim, dtype, device, strided) for _ in range(2))
    k_cache, v_cache = (_randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
                        for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    K.store_kv(k, v, k_cache, v_cache, slots)
    K.store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "cache contents differ"


def _check_rotary_store_kv(dtype: torch.dtype, device: str, n: int, heads: tuple[int, int], head_dim: int,
                           block_size: int, index_dtype: torch.dtype, strided: bool) -> None:
    cos_sin = K.rotary_cos_sin_cache(head_dim, 4096, 10000.0, device)
    positions = torch.randint(0, 4096, (n,), dtype=index_dtype).to(device)
    num_blocks = -(-n // block_size) + 2
    slots = torch.randperm(num_blocks * block_size)[:n].to(index_dtype)
    slots[1::3] = -1  # padding tokens: rotated, not written
    slots = slots.to(device)
    q, k, v = _qkv(n, heads, head_dim, dtype, device, strided)
    k_cache, v_cache = (_randn(num_blocks, block_size, heads[1], head_dim, dtype=dtype, device=device)
                        for _ in range(2))
    q_ref, k_ref, k_cache_ref, v_cache_ref = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    K.rotary_store_kv_ref(q_ref, k_ref, v, positions, cos_sin, k_cache_ref, v_cache_ref, slots)
    q_out, k_out = K.rotary_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    assert q_out is q and k_out is k, "rotary_store_kv must rotate in place"
    _assert_close(q, q_ref, dtype)
    _assert_close(k, k_ref, dtype)
    _assert_close(k_cache, k_cache_ref, dtype)
    assert torch.equal(v_cache, v_cache_ref), "v cache contents differ"
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, *k.shape[1:])[slots[keep].long()], k[keep]), "cached k != rotated k"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[keep].long()] = False
    assert torch.equal(k_cache.view(-1, *k.shape[1:])[untouched], k_cache_ref.view(-1, *k.shape[1:])[untouched])


def _check_decode(dtype: torch.dtype, device: str, context_lens: list[int], heads: tuple[int, int],
                  head_dim: int, block_size: int, num_splits: int | None, strided: bool) -> None:
    k_cache, v_cache, table = _paged_cache(context_lens, heads[1], head_dim, block_size, dtype, device)
    q = _heads(len(context_lens), heads[0], head_dim, dtype, device, strided)
    lens, scale = _int32(context_lens, device), head_dim**-0.5
    out = K.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, num_splits=num_splits)
    _assert_close(out, K.paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale), dtype)


EARLY_LENS = {  # what the tile-split kernel may read as context lengths before its wait, from the true ones
    "true": lambda lens: lens,
    "stale": lambda lens: (lens - 1).clamp(min=0),  # the step before's, as a step that has not written them yet
    "long": lambda lens: lens + 37,  # past the context: tokens this step writes, or no one wrote
    "garbage": lambda lens: torch.randint(-9, 10**6, lens.shape, dtype=torch.int32, device=lens.device),
}


def _check_tile_splits(dtype: torch.dtype, device: str, context_lens: list[int], heads: tuple[int, int],
                       head_dim: int, block_size: int, block_n: int, num_warps: int, early: str) -> None:
    """The one-tile splits of small decode batches, with the early context lengths right or wrong, merged in
    the kernel (its counters back at zero after)."""
    from chattts_velocity.kernels._triton import _launch
    from chattts_velocity.kernels._triton.decode_attention import tile_splits

    k_cache, v_cache, table = _paged_cache(context_lens, heads[1], head_dim, block_size, dtype, device)
    q = _heads(len(context_lens), heads[0], head_dim, dtype, device, strided=True)
    lens, scale = _int32(context_lens, device), head_dim**-0.5
    counters = torch.zeros(q.shape[0] * q.shape[1] + 3, dtype=torch.int32, device=device)
    pdl = _launch.pdl_launch(torch.device(device))  # on a GPU as the engine launches it
    out = tile_splits(q, k_cache, v_cache, table, lens, scale, block_n, num_warps, counters,
                      EARLY_LENS[early](lens), pdl)
    _assert_close(out, K.paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale), dtype)
    assert not counters.any(), f"counters left at {counters.tolist()}"


def _check_prefill(dtype: torch.dtype, device: str, seqs: list[tuple[int, int]], heads: tuple[int, int],
                   head_dim: int, block_size: int, strided: bool) -> None:
    """``seqs``: (q_len, context_len) per sequence."""
    q_lens, context_lens = [q_len for q_len, _ in seqs], [ctx for _, ctx in seqs]
    k_cache, v_cache, table = _paged_cache(context_lens, heads[1], head_dim, block_size, dtype, device)
    cu = _int32([0] + torch.tensor(q_lens).cumsum(0).tolist(), device)
    q = _heads(sum(q_lens), heads[0], head_dim, dtype, device, strided)
    lens, scale = _int32(context_lens, device), head_dim**-0.5
    out = K.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale)
    _assert_close(out, K.paged_prefill_attention_ref(q, k_cache, v_cache, table, cu, lens, scale), dtype)


def _check_fused_linear(dtype: torch.dtype, device: str, m: int, k: int, n: int, norm: bool, residual: bool,
                        gated: bool) -> None:
    """``n`` output features (a gated weight has 2n rows)."""
    x = _randn(m, k, dtype=dtype, device=device)
    weight = _randn(2 * n if gated else n, k, dtype=dtype, device=device, std=k**-0.5)
    kw = dict(norm_weight=_randn(k, dtype=dtype, device=device, std=0.1, mean=1.0) if norm else None, eps=1e-6,
              residual=_randn(m, k, dtype=dtype, device=device) if residual else None, gated=gated)
    out, expected = K.fused_linear(x, weight, **kw), K.fused_linear_ref(x, weight, **kw)
    if residual:
        assert torch.equal(out[1], expected[1]), "new residual differs"
        out, expected = out[0], expected[0]
    assert out.shape == (m, n)
    _assert_close(out, expected, dtype)


def _check_qkv_rotary(dtype: torch.dtype, device: str, m: int, k: int, heads: tuple[int, int], head_dim: int,
                      block_size: int, residual: bool, skip_slot: bool) -> None:
    """The layer front: norm (+ residual) + q/k/v GEMM, then rotary and the KV write, against the references;
    ``skip_slot``: the token's slot is -1 (a step past its sequence's end writes no KV)."""
    q_heads, kv_heads = heads
    x = _randn(m, k, dtype=dtype, device=device)
    weight = _randn((q_heads + 2 * kv_heads) * head_dim, k, dtype=dtype, device=device, std=k**-0.5)
    cos_sin = K.rotary_cos_sin_cache(head_dim, 4096, 10000.0, device)
    positions = torch.randint(0, 4096, (m,)).to(device)
    num_blocks = -(-m // block_size) + 2
    slots = torch.randperm(num_blocks * block_size)[:m]
    if skip_slot:
        slots[0] = -1
    slots = slots.to(device)
    k_cache, v_cache = (_randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
                        for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kw = dict(norm_weight=_randn(k, dtype=dtype, device=device, std=0.1, mean=1.0), eps=1e-6,
              residual=_randn(m, k, dtype=dtype, device=device) if residual else None, positions=positions,
              cos_sin_cache=cos_sin, slot_mapping=slots, num_heads=q_heads, num_kv_heads=kv_heads)
    qkv, new_res = K.fused_qkv_rotary_store(x, weight, k_cache=k_cache, v_cache=v_cache, **kw)
    qkv_ref, new_res_ref = K.fused_qkv_rotary_store_ref(x, weight, k_cache=k_ref, v_cache=v_ref, **kw)
    if residual:
        assert torch.equal(new_res, new_res_ref), "new residual differs"
    else:
        assert new_res is None and new_res_ref is None
    _assert_close(qkv, qkv_ref, dtype)
    _assert_close(k_cache, k_ref, dtype)
    _assert_close(v_cache, v_ref, dtype)
    keep = slots >= 0
    kv = qkv[:, q_heads * head_dim :].view(m, 2, kv_heads, head_dim)
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[slots[keep]], kv[keep, 0]), "cached k != rotated k"
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots[keep]], kv[keep, 1]), "cached v != v"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[untouched], k_ref.view(-1, kv_heads, head_dim)[untouched])


def _check_step_inputs(dtype: torch.dtype, device: str, b: int, q: int, vocab: int, hidden: int,
                       block_size: int) -> None:
    """The step's embedding (float32 table summed, rounded to ``dtype``), KV slots (-1 past a row's limit),
    rotary positions (clamped to the table) and context lengths."""
    width = 5
    tokens = torch.randint(0, vocab, (b, q + 1))[:, :q].to(device)  # a row-strided view, as the state buffer is
    table = _randn(q * vocab, hidden, dtype=torch.float32, device=device)
    positions = torch.randint(0, width * block_size + 8, (b,))
    positions[0] = 4095  # past the rotary table of 4095 positions below
    limit = positions + torch.tensor([1, 0, 5])[torch.arange(b) % 3]  # limit == position: no KV write
    tables = torch.randperm(max(40, b * width))[: b * width].view(b, width).to(torch.int32)
    args = (tokens, table, vocab, positions.to(device), limit.to(device), tables.to(device), block_size, 4095,
            dtype)
    emb, slots, rope, ctx = K.step_inputs(*args)
    emb_ref, slots_ref, rope_ref, ctx_ref = K.step_inputs_ref(*args)
    _assert_close(emb, emb_ref, dtype)
    assert emb.dtype == dtype and torch.equal(slots, slots_ref) and torch.equal(rope, rope_ref)
    assert torch.equal(ctx, ctx_ref) and ctx.dtype == torch.int32
    assert (slots_ref >= 0).any() and (rope_ref == 4094).any() and (b < 2 or (slots_ref == -1).any())


def _check_step_outputs(dtype: torch.dtype, device: str, b: int, q: int, hidden: int, text: bool) -> None:
    """The step's records and state updates; ``text``: one sampling row a sequence, its token repeated over
    the Q columns (an expanded view)."""
    steps, b_max, width = 3, b + 2, 16
    rows = b if text else b * q
    flat = torch.randint(0, 600, (rows,)).to(device)
    step_tokens = flat[:, None].expand(b, q) if text else flat.view(b, q)
    hid = _randn(b, hidden, dtype=torch.float32, device=device)
    state = dict(out_tokens=torch.randint(0, 9, (steps, b_max, q)), out_hidden=torch.randn(steps, b_max, hidden),
                 step_out=torch.tensor(1), tokens=torch.randint(0, 9, (b_max, q)),
                 history=torch.randint(-1, 600, (b_max * q, width)), step=torch.randint(0, 50, (b_max * q,)),
                 positions=torch.randint(0, 90, (b_max,)))
    state = {k: v.to(device) for k, v in state.items()}
    ref = {k: v.clone() for k, v in state.items()}
    K.step_outputs(step_tokens, flat, hid, **state)
    K.step_outputs_ref(step_tokens, flat, hid, **ref)
    for name in state:
        assert torch.equal(state[name], ref[name]), f"{name} differs"
    assert torch.equal(ref["history"][:rows, -1], flat) and torch.equal(ref["out_tokens"][1, :b], step_tokens)


CHECKS = {
    "step_inputs": _check_step_inputs,
    "step_outputs": _check_step_outputs,
    "rms_norm": _check_rms_norm,
    "apply_rotary": _check_apply_rotary,
    "silu_and_mul": _check_silu_and_mul,
    "store_kv": _check_store_kv,
    "rotary_store_kv": _check_rotary_store_kv,
    "paged_decode_attention": _check_decode,
    "tile_splits": _check_tile_splits,
    "paged_prefill_attention": _check_prefill,
    "fused_linear": _check_fused_linear,
    "fused_qkv_rotary_store": _check_qkv_rotary,
}


@dataclass(frozen=True)
class Case:
    """One kernel-vs-reference comparison: ``CHECKS[op](dtype, device, **params)``."""

    op: str
    name: str
    dtype: str
    params: dict

    def __str__(self) -> str:
        return f"{self.op}-{self.name}-{self.dtype}"

    def run(self, device: str) -> None:
        torch.manual_seed(0)
        CHECKS[self.op](DTYPES[self.dtype], device, **self.params)


def _cases(dtypes: tuple[str, ...], specs: list[tuple[str, str, dict]]) -> list[Case]:
    return [Case(op, name, dtype, params) for op, name, params in specs for dtype in dtypes]


def _norm(name: str, n: int, hidden: int, residual: bool = False) -> tuple[str, str, dict]:
    return "rms_norm", name, dict(n=n, hidden=hidden, residual=residual)


def _rotary(name: str, n: int, heads: tuple[int, int], head_dim: int, positions_dtype=torch.int64,
            strided: bool = False) -> tuple[str, str, dict]:
    return "apply_rotary", name, dict(n=n, heads=heads, head_dim=head_dim, positions_dtype=positions_dtype,
                                      strided=strided)


def _silu(name: str, n: int, inter: int) -> tuple[str, str, dict]:
    return "silu_and_mul", name, dict(n=n, inter=inter)


def _store(name: str, n: int, kv_heads: int, head_dim: int, block_size: int,
           strided: bool = False) -> tuple[str, str, dict]:
    return "store_kv", name, dict(n=n, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                                  strided=strided)


def _rotary_store(name: str, n: int, heads: tuple[int, int], head_dim: int, block_size: int,
                  index_dtype=torch.int64, strided: bool = False) -> tuple[str, str, dict]:
    return "rotary_store_kv", name, dict(n=n, heads=heads, head_dim=head_dim, block_size=block_size,
                                         index_dtype=index_dtype, strided=strided)


def _decode(name: str, context_lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int,
            num_splits: int | None = None, strided: bool = False) -> tuple[str, str, dict]:
    return "paged_decode_attention", name, dict(context_lens=context_lens, heads=heads, head_dim=head_dim,
                                                block_size=block_size, num_splits=num_splits, strided=strided)


def _tile_splits(name: str, context_lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int,
                 block_n: int, early: str, num_warps: int = 4) -> tuple[str, str, dict]:
    return "tile_splits", name, dict(context_lens=context_lens, heads=heads, head_dim=head_dim,
                                     block_size=block_size, block_n=block_n, num_warps=num_warps, early=early)


def _prefill(name: str, seqs: list[tuple[int, int]], heads: tuple[int, int], head_dim: int, block_size: int,
             strided: bool = False) -> tuple[str, str, dict]:
    return "paged_prefill_attention", name, dict(seqs=seqs, heads=heads, head_dim=head_dim,
                                                 block_size=block_size, strided=strided)


def _linear(name: str, m: int, k: int, n: int, norm: bool = False, residual: bool = False,
            gated: bool = False) -> tuple[str, str, dict]:
    return "fused_linear", name, dict(m=m, k=k, n=n, norm=norm, residual=residual, gated=gated)


def _qkv_rotary(name: str, m: int, k: int, heads: tuple[int, int], head_dim: int, block_size: int,
                residual: bool = False, skip_slot: bool = False) -> tuple[str, str, dict]:
    return "fused_qkv_rotary_store", name, dict(m=m, k=k, heads=heads, head_dim=head_dim, block_size=block_size,
                                                residual=residual, skip_slot=skip_slot)


INTERPRETER_CASES = _cases(("fp32", "fp16"), [
    ("step_inputs", "b1_q4", dict(b=1, q=4, vocab=7, hidden=40, block_size=4)),
    ("step_inputs", "b3_text_q1", dict(b=3, q=1, vocab=11, hidden=32, block_size=16)),
    ("step_outputs", "b1_audio", dict(b=1, q=4, hidden=40, text=False)),
    ("step_outputs", "b3_text", dict(b=3, q=4, hidden=32, text=True)),
    _norm("n1_h40", 1, 40),
    _norm("n3_h72_residual", 3, 72, residual=True),
    _norm("n17_h40_residual", 17, 40, residual=True),
    _norm("n33_h72", 33, 72),
    _rotary("n1_d16", 1, (4, 4), 16),
    _rotary("n5_gqa_int32_strided", 5, (6, 2), 32, positions_dtype=torch.int32, strided=True),
    _rotary("n17_heads3_strided", 17, (3, 1), 16, strided=True),
    _silu("n1_i40", 1, 40),
    _silu("n3_i72", 3, 72),
    _silu("n2_i1100_two_column_blocks", 2, 1100),
    _store("n1_bs4", 1, 2, 16, 4),
    _store("n17_heads3_bs16_strided", 17, 3, 32, 16, strided=True),
    _rotary_store("n1_d16_bs4", 1, (4, 4), 16, 4),
    _rotary_store("n5_gqa_int32_bs4_strided", 5, (6, 2), 32, 4, index_dtype=torch.int32, strided=True),
    _rotary_store("n17_heads3_bs16_strided", 17, (3, 3), 16, 16, strided=True),
    _decode("odd_lens_bs4", [1, 17, 50], (2, 2), 16, 4),
    _decode("gqa_3_splits_strided", [33, 5], (4, 2), 32, 16, num_splits=3, strided=True),
    _decode("8_splits_with_empty_context", [70, 1, 0], (3, 1), 16, 4, num_splits=8),
    _tile_splits("gqa_true_lens", [1, 7, 8, 9, 30, 0], (4, 2), 16, 4, 8, "true"),
    _tile_splits("stale_lens", [2, 8, 17, 31], (2, 2), 16, 4, 8, "stale"),
    _tile_splits("long_lens", [1, 9, 23], (2, 1), 16, 4, 8, "long"),
    _tile_splits("garbage_lens", [5, 16, 33, 0], (3, 3), 16, 4, 8, "garbage"),
    _prefill("mixed_decode_full_and_prefix", [(1, 1), (17, 17), (5, 40)], (2, 2), 16, 4),
    _prefill("gqa_prefix_longer_than_q_strided", [(33, 33), (1, 20), (3, 70)], (4, 2), 32, 16, strided=True),
    _prefill("one_seq_three_q_tiles", [(40, 40)], (1, 1), 16, 4),
    _linear("m1_plain_ragged_n_and_k", 1, 40, 24),
    _linear("m5_norm", 5, 48, 16, norm=True),
    _linear("m16_norm_residual", 16, 80, 40, norm=True, residual=True),
    _linear("m3_norm_residual_gated", 3, 48, 24, norm=True, residual=True, gated=True),
    _linear("m17_unfused_fallback", 17, 32, 16, norm=True, residual=True, gated=True),
    _linear("m2_gemv_rows_norm_residual", 2, 40, 48, norm=True, residual=True),
    _linear("m6_gemv_rows_long_k", 6, 72, 24),
    _linear("m12_skinny_long_k", 12, 72, 24),
    _linear("m4_prefetch_norm_residual_ragged", 4, 40, 56, norm=True, residual=True),
    _linear("m7_prefetch_norm_residual_gated", 7, 32, 40, norm=True, residual=True, gated=True),
    _linear("m1_norm_residual_ragged_k", 1, 40, 24, norm=True, residual=True),
    _linear("m1_norm_residual_gated_ragged_n", 1, 48, 22, norm=True, residual=True, gated=True),
    _linear("m1_long_k", 1, 72, 12),
    _qkv_rotary("m1_heads_2_2_d16", 1, 40, (2, 2), 16, 4),
    _qkv_rotary("m1_gqa_residual_d8", 1, 48, (3, 1), 8, 4, residual=True),
    _qkv_rotary("m1_skipped_slot", 1, 32, (2, 2), 16, 4, residual=True, skip_slot=True),
    _qkv_rotary("m2_gemv_rows", 2, 32, (2, 1), 16, 4, residual=True),
    _qkv_rotary("m3_prefetch", 3, 32, (2, 1), 16, 4, residual=True),
    _qkv_rotary("m5_prefetch_skipped_slot", 5, 32, (2, 2), 16, 4, skip_slot=True),
    _qkv_rotary("m9_two_launches", 9, 32, (2, 1), 16, 4, residual=True),
])

# The real model: hidden 768, 12 q and 12 KV heads of 64, intermediate 3072, 16-token blocks.
_LENS = [1, 15, 16, 17, 500, 1000, 2000]
_RANDOM_LENS = torch.randint(1, 2001, (256,), generator=torch.Generator().manual_seed(1)).tolist()
GPU_CASES = _cases(("fp32", "fp16", "bf16"), [
    ("step_inputs", "b1_model", dict(b=1, q=4, vocab=626, hidden=768, block_size=16)),
    ("step_inputs", "b256_text", dict(b=256, q=1, vocab=21178, hidden=768, block_size=16)),
    ("step_outputs", "b1_audio_model", dict(b=1, q=4, hidden=768, text=False)),
    ("step_outputs", "b256_text_model", dict(b=256, q=4, hidden=768, text=True)),
    _norm("n1_h768", 1, 768),
    _norm("n33_h768_residual", 33, 768, residual=True),
    _norm("n2000_h768_residual", 2000, 768, residual=True),
    _norm("n3_h40_residual", 3, 40, residual=True),
    _rotary("n1_strided", 1, (12, 12), 64, strided=True),
    _rotary("n2048_strided", 2048, (12, 12), 64, strided=True),
    _rotary("n17_gqa_int32", 17, (12, 4), 64, positions_dtype=torch.int32),
    _silu("n1_i3072", 1, 3072),
    _silu("n257_i3072", 257, 3072),
    _silu("n3_i72", 3, 72),
    _store("n1_strided", 1, 12, 64, 16, strided=True),
    _store("n257_strided", 257, 12, 64, 16, strided=True),
    _rotary_store("n1_strided", 1, (12, 12), 64, 16, strided=True),
    _rotary_store("n2048_strided", 2048, (12, 12), 64, 16, strided=True),
    _rotary_store("n17_gqa_int32", 17, (12, 4), 64, 16, index_dtype=torch.int32),
    _decode("b1_ctx1999_auto_splits_strided", [1999], (12, 12), 64, 16, strided=True),
    _decode("b7_mixed_lens_auto_splits", _LENS, (12, 12), 64, 16),
    _decode("b7_mixed_lens_no_split", _LENS, (12, 12), 64, 16, num_splits=1),
    _decode("b256_random_lens", _RANDOM_LENS, (12, 12), 64, 16),
    _decode("b96_random_lens_values_early_strided", _RANDOM_LENS[:96], (12, 12), 64, 16, strided=True),
    _decode("b88_gqa_values_early", [1 + 23 * i for i in range(88)], (12, 4), 64, 16),
    _decode("b3_gqa_5_splits", [300, 1, 1777], (12, 4), 64, 16, num_splits=5),
    _decode("b16_auto_one_tile_splits", [1 + 125 * i for i in range(16)], (12, 12), 64, 16),
    _tile_splits("b7_true_lens", [1, 255, 256, 257, 513, 1999, 37], (12, 12), 64, 16, 256, "true"),
    _tile_splits("b4_stale_lens_128", [2, 128, 129, 1000], (12, 12), 64, 16, 128, "stale"),
    _tile_splits("b3_long_lens", [1, 300, 700], (12, 12), 64, 16, 256, "long"),
    _tile_splits("b5_gqa_garbage_lens_8_warps", [3, 256, 600, 0, 1200], (12, 4), 64, 16, 256, "garbage",
                 num_warps=8),
    _prefill("one_seq_2000", [(2000, 2000)], (12, 12), 64, 16),
    _prefill("decodes_chunks_prefix_strided", [(1, 1000), (37, 1500), (500, 500), (1, 1), (129, 200)],
             (12, 12), 64, 16, strided=True),
    _prefill("gqa_prefix", [(100, 1100), (64, 64), (3, 3)], (12, 4), 64, 16),
    _linear("m1_qkv_norm", 1, 768, 2304, norm=True),
    _linear("m1_o", 1, 768, 768),
    _linear("m16_gate_up_norm_residual", 16, 768, 3072, norm=True, residual=True, gated=True),
    _linear("m7_down", 7, 3072, 768),
    _linear("m2_o", 2, 768, 768),
    _linear("m12_down", 12, 3072, 768),
    _linear("m5_o", 5, 768, 768),
    _linear("m64_qkv_norm_residual_unfused", 64, 768, 2304, norm=True, residual=True),
    _linear("m1_gate_up_norm_residual", 1, 768, 3072, norm=True, residual=True, gated=True),
    _linear("m1_down", 1, 3072, 768),
    _qkv_rotary("m1_model", 1, 768, (12, 12), 64, 16, residual=True),
    _qkv_rotary("m1_model_first_layer_skipped_slot", 1, 768, (12, 12), 64, 16, skip_slot=True),
    _qkv_rotary("m16_model", 16, 768, (12, 12), 64, 16, residual=True),
    _qkv_rotary("m2_model", 2, 768, (12, 12), 64, 16, residual=True),
    _qkv_rotary("m7_model_skipped_slot", 7, 768, (12, 12), 64, 16, skip_slot=True),
    _prefill("64_decodes_and_a_prefill", [(1, 300 + 23 * i) for i in range(64)] + [(700, 900)], (12, 12),
             64, 16),
])


# ------------------------------------------------------------------------------- the interpreter subprocess


def interpreter_main() -> None:
    """Entry point of the subprocess: run every interpreter case, print one JSON line of results."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    fix_interpreter_for_numpy_2_4()
    from triton.runtime.interpreter import InterpretedFunction

    launched = set()  # the modules of the kernels launched (an imported module may run nothing: one kernel
    run = InterpretedFunction.run  # module calls another's helpers)

    def recording_run(self, *args, **kwargs):
        launched.add(self.fn.__module__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recording_run
    results = {}
    for case in INTERPRETER_CASES:
        try:
            case.run("cpu")
            results[str(case)] = ""
        except Exception as e:  # reported per case by the parent test
            results[str(case)] = f"{type(e).__name__}: {e}"
    modules = sorted(m for m in launched if m.startswith("chattts_velocity.kernels._triton."))
    report({"cases": results, "triton_modules": modules})


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    return run_interpreter_main("test_kernels")


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=str)
def test_triton_interpreter_matches_reference(case: Case, interpreter_results: dict) -> None:
    error = interpreter_results["cases"][str(case)]
    assert not error, f"{case}: {error}"


def test_interpreter_ran_every_triton_module(interpreter_results: dict) -> None:
    """Guards against the cases silently comparing the reference with itself: every kernel module launched."""
    modules = {"norm", "rotary", "activation", "kv_cache", "rotary_store_kv", "decode_attention",
               "prefill_attention", "linear", "gemv", "prefetch_linear", "step_io"}
    ran = {name.rsplit(".", 1)[1] for name in interpreter_results["triton_modules"]}
    assert modules <= ran, f"never ran on Triton: {modules - ran}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_triton_gpu_matches_reference(case: Case) -> None:
    case.run("cuda")


# ------------------------------------------------------------------------- references vs independent maths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_ref_equals_transformers_llama_rms_norm(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(72, eps=1e-5).to(dtype)
    norm.weight.data = _randn(72, dtype=dtype, device="cpu", std=0.1, mean=1.0)
    x, residual = _randn(5, 72, dtype=dtype, device="cpu"), _randn(5, 72, dtype=dtype, device="cpu")
    with torch.no_grad():
        assert torch.equal(K.rms_norm_ref(x, norm.weight, 1e-5), norm(x))
        out, new_residual = K.rms_norm_ref(x, norm.weight, 1e-5, residual)
        assert torch.equal(new_residual, x + residual) and torch.equal(out, norm(x + residual))


def _hf_rotary(head_dim: int, theta: float):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": theta}
    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=4096, rope_parameters=rope)
    return LlamaRotaryEmbedding(config)


def test_rotary_cache_equals_transformers_cos_sin() -> None:
    positions = torch.arange(4096)[None]  # [1, P]
    cos, sin = _hf_rotary(64, 10000.0)(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D]
    cache = K.rotary_cos_sin_cache(64, 4096, 10000.0, "cpu")
    assert cache.dtype == torch.float32 and cache.shape == (4096, 64)
    assert torch.equal(cache[:, :32], cos[0, :, :32]) and torch.equal(cache[:, 32:], sin[0, :, :32])


def test_apply_rotary_ref_matches_transformers_apply_rotary_pos_emb() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k, positions = torch.randn(9, 4, 32), torch.randn(9, 2, 32), torch.randint(0, 4096, (9,))
    cos, sin = _hf_rotary(32, 10000.0)(q, positions[None])  # [1, N, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)  # [1,H,N,D]
    q_ref, k_ref = K.apply_rotary_ref(q, k, positions, K.rotary_cos_sin_cache(32, 4096, 10000.0, "cpu"))
    torch.testing.assert_close(q_ref, q_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_ref, k_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_silu_and_mul_ref_is_silu_gate_times_up_in_float32() -> None:
    x = torch.randn(4, 2 * 24, dtype=torch.float16) * 3
    gate, up = x.float()[:, :24], x.float()[:, 24:]
    out = K.silu_and_mul_ref(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, (gate / (1 + torch.exp(-gate)) * up).half())


def test_store_kv_ref_writes_slots_and_skips_negative_ones() -> None:
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    K.store_kv_ref(k, v, k_cache, v_cache, torch.tensor([13, -1, 2]))
    assert torch.equal(k_cache[3, 1], k[0]) and torch.equal(v_cache[0, 2], v[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2, "the skipped token was written"


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, Hq, D] as the last L of T positions over k, v [T, Hk, D], via SDPA on the unpaged sequence."""
    length, total = q.shape[0], k.shape[0]
    mask = torch.ones(total, total, dtype=torch.bool).tril()[total - length :]  # [L, T]
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L or T, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)  # [1,Hq,L,D]
    return out[0].transpose(0, 1)


def test_paged_attention_refs_match_dense_sdpa_on_unpaged_sequences() -> None:
    torch.manual_seed(0)
    seqs, block_size, scale = [(1, 1), (6, 6), (3, 29), (1, 40)], 4, 0.3  # (q_len, context_len)
    dense_k = [torch.randn(ctx, 2, 16) for _, ctx in seqs]
    dense_v = [torch.randn(ctx, 2, 16) for _, ctx in seqs]
    k_cache, v_cache, table = _paged_cache([ctx for _, ctx in seqs], 2, 16, block_size, torch.float32, "cpu")
    for s, (_, ctx) in enumerate(seqs):  # scatter the dense sequences into their shuffled blocks
        slots = table[s, torch.arange(ctx) // block_size].long() * block_size + torch.arange(ctx) % block_size
        k_cache.view(-1, 2, 16)[slots], v_cache.view(-1, 2, 16)[slots] = dense_k[s], dense_v[s]
    q = torch.randn(sum(q_len for q_len, _ in seqs), 4, 16)
    cu = torch.tensor([0, 1, 7, 10, 11], dtype=torch.int32)
    lens = torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32)
    out = K.paged_prefill_attention_ref(q, k_cache, v_cache, table, cu, lens, scale)
    for s in range(len(seqs)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        torch.testing.assert_close(out[rows], _dense_causal(q[rows], dense_k[s], dense_v[s], scale))
    last = cu[1:] - 1  # each sequence's newest token, as a decode batch
    decode = K.paged_decode_attention_ref(q[last], k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(decode, out[last])


def test_decode_ref_gives_zeros_for_an_empty_context() -> None:
    k_cache, v_cache, table = _paged_cache([0, 3], 1, 16, 4, torch.float32, "cpu")
    lens = _int32([0, 3], "cpu")
    out = K.paged_decode_attention_ref(torch.randn(2, 1, 16), k_cache, v_cache, table, lens, 1.0)
    assert torch.equal(out[0], torch.zeros(1, 16)) and out[1].abs().sum() > 0


# ---------------------------------------------------------------------------------- launcher argument checks


def _cache(num_kv_heads: int = 2, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(4, 4, num_kv_heads, 16, dtype=dtype)  # [num_blocks, block_size, Hk, D]


_LONG2 = torch.zeros(2, dtype=torch.long)
_VALID = {  # op -> valid arguments (q heads 4 over 2 KV heads of 16), so each rejection is about one override
    "rms_norm": lambda: dict(x=torch.randn(3, 40), weight=torch.ones(40), eps=1e-6,
                             residual=torch.randn(3, 40)),
    "apply_rotary": lambda: dict(q=torch.randn(2, 4, 16), k=torch.randn(2, 2, 16), positions=_LONG2,
                                 cos_sin_cache=torch.zeros(8, 16)),
    "silu_and_mul": lambda: dict(x=torch.randn(2, 8)),
    "store_kv": lambda: dict(k=torch.randn(2, 2, 16), v=torch.randn(2, 2, 16), k_cache=_cache(),
                             v_cache=_cache(), slot_mapping=_LONG2),
    "rotary_store_kv": lambda: dict(q=torch.randn(2, 4, 16), k=torch.randn(2, 2, 16), v=torch.randn(2, 2, 16),
                                    positions=_LONG2, cos_sin_cache=torch.zeros(8, 16), k_cache=_cache(),
                                    v_cache=_cache(), slot_mapping=_LONG2),
    "fused_linear": lambda: dict(x=torch.randn(3, 40), weight=torch.randn(16, 40), norm_weight=torch.ones(40),
                                 residual=torch.randn(3, 40), gated=True),
    "fused_qkv_rotary_store": lambda: dict(x=torch.randn(2, 40), weight=torch.randn(128, 40),
                                           norm_weight=torch.ones(40), eps=1e-6, residual=torch.randn(2, 40),
                                           positions=_LONG2, cos_sin_cache=torch.zeros(8, 16), k_cache=_cache(),
                                           v_cache=_cache(), slot_mapping=_LONG2, num_heads=4, num_kv_heads=2),
    "paged_decode_attention": lambda: dict(q=torch.randn(2, 4, 16), k_cache=_cache(), v_cache=_cache(),
                                           block_tables=_int32([[0, 1], [2, 3]], "cpu"),
                                           context_lens=_int32([5, 8], "cpu"), scale=0.25),
    "paged_prefill_attention": lambda: dict(q=torch.randn(3, 4, 16), k_cache=_cache(), v_cache=_cache(),
                                            block_tables=_int32([[0, 1], [2, 3]], "cpu"),
                                            cu_seqlens_q=_int32([0, 1, 3], "cpu"),
                                            context_lens=_int32([5, 8], "cpu"), scale=0.25),
}
BAD_ARGS = {  # test id -> (op, overrides, expected message)
    "qkv_rows_not_the_heads": ("fused_qkv_rotary_store", dict(weight=torch.randn(96, 40)),
                               r"weight has 96 rows, not \(num_heads \+ 2 num_kv_heads\) \* head_dim = 128"),
    "qkv_cache_heads": ("fused_qkv_rotary_store", dict(num_heads=2, num_kv_heads=3, weight=torch.randn(128, 40)),
                        r"k heads/dim \(3, 16\) != cache heads/dim \(2, 16\)"),
    "rms_norm_3d_x": ("rms_norm", dict(x=torch.zeros(2, 3, 40)), r"x must be \[N, H\]"),
    "rms_norm_int_x": ("rms_norm", dict(x=torch.zeros(3, 40, dtype=torch.int32)),
                       "x must have dtype float32, float16, bfloat16"),
    "rms_norm_weight_size": ("rms_norm", dict(weight=torch.ones(41)), "weight has 41 elements"),
    "rms_norm_weight_dtype": ("rms_norm", dict(weight=torch.ones(40).half()),
                              "weight must have dtype float32"),
    "rms_norm_residual_shape": ("rms_norm", dict(residual=torch.zeros(4, 40)), "residual shape"),
    "rms_norm_noncontiguous_x": ("rms_norm", dict(x=torch.zeros(40, 3).T, weight=torch.ones(3),
                                                  residual=None), "x must be contiguous"),
    "rotary_head_dim_not_power_of_two": ("apply_rotary", dict(q=torch.zeros(2, 4, 24),
                                                              k=torch.zeros(2, 2, 24),
                                                              cos_sin_cache=torch.zeros(8, 24)),
                                         "head_dim must be a power of two"),
    "rotary_half_cache": ("apply_rotary", dict(cos_sin_cache=torch.zeros(8, 16).half()),
                          "cos_sin_cache must have dtype float32"),
    "rotary_positions_count": ("apply_rotary", dict(positions=torch.zeros(3, dtype=torch.long)),
                               "positions has 3 entries"),
    "rotary_strided_last_dim": ("apply_rotary", dict(q=torch.zeros(2, 16, 4).transpose(1, 2)),
                                "q must be contiguous in its last dim"),
    "silu_odd_width": ("silu_and_mul", dict(x=torch.zeros(2, 7)), "odd last dim 7"),
    "store_kv_head_mismatch": ("store_kv", dict(k=torch.zeros(2, 3, 16), v=torch.zeros(2, 3, 16)),
                               "k heads/dim"),
    "store_kv_float_slots": ("store_kv", dict(slot_mapping=torch.zeros(2)),
                             "slot_mapping must have dtype int32"),
    "store_kv_noncontiguous_cache": ("store_kv", dict(k_cache=torch.zeros(4, 2, 4, 16).transpose(1, 2)),
                                     "k_cache must be contiguous"),
    "rotary_store_kv_positions_count": ("rotary_store_kv", dict(positions=torch.zeros(3, dtype=torch.long)),
                                        "positions has 3 entries"),
    "rotary_store_kv_float_slots": ("rotary_store_kv", dict(slot_mapping=torch.zeros(2)),
                                    "slot_mapping must have dtype int32"),
    "rotary_store_kv_v_shape": ("rotary_store_kv", dict(v=torch.zeros(2, 3, 16)), "v shape"),
    "linear_inner_size": ("fused_linear", dict(weight=torch.randn(16, 41)), "weight has 41 inputs"),
    "linear_odd_gated_rows": ("fused_linear", dict(weight=torch.randn(15, 40)), "odd row count 15"),
    "linear_residual_without_norm": ("fused_linear", dict(norm_weight=None),
                                     "a residual is only added in front of a norm"),
    "linear_half_weight": ("fused_linear", dict(weight=torch.randn(16, 40).half()),
                           "weight must have dtype float32"),
    "decode_heads_not_multiple": ("paged_decode_attention", dict(q=torch.zeros(2, 3, 16)),
                                  r"q heads \(3\) must be a multiple of KV heads \(2\)"),
    "decode_int64_block_tables": ("paged_decode_attention", dict(block_tables=torch.zeros(2, 2).long()),
                                  "block_tables must have dtype int32"),
    "decode_batch_mismatch": ("paged_decode_attention", dict(q=torch.zeros(3, 4, 16)), "batch sizes differ"),
    "decode_half_q": ("paged_decode_attention", dict(q=torch.zeros(2, 4, 16).half()),
                      "q dtype torch.float16 != cache dtype torch.float32"),
    "decode_zero_splits": ("paged_decode_attention", dict(num_splits=0),
                           "num_splits must be None or an int >= 1"),
    "decode_too_few_split_counters": ("paged_decode_attention",
                                      dict(split_counters=torch.zeros(7, dtype=torch.int32)),
                                      "split_counters holds 7 counters, fewer than the 8"),
    "decode_int64_split_counters": ("paged_decode_attention", dict(split_counters=torch.zeros(8).long()),
                                    "split_counters must have dtype int32"),
    "prefill_sequence_count": ("paged_prefill_attention", dict(cu_seqlens_q=_int32([0, 1, 2, 3], "cpu")),
                               "sequence counts differ"),
    "prefill_int64_context_lens": ("paged_prefill_attention", dict(context_lens=torch.zeros(2).long()),
                                   "context_lens must have dtype int32"),
}


@pytest.mark.parametrize(("op", "overrides", "message"), BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_launcher_rejects_bad_arguments_with_a_clear_message(op: str, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        getattr(K, op)(**{**_VALID[op](), **overrides})


@pytest.mark.parametrize("op", _VALID)
def test_launcher_accepts_the_valid_arguments(op: str) -> None:
    getattr(K, op)(**_VALID[op]())


def test_the_decode_linears_pick_their_kernel_by_rows_and_shape(monkeypatch) -> None:
    """Up to ``PREFETCH_ROWS`` rows the kernels that load their weights first: the GEMV over rows while the
    rows are few (more of them for long rows, as the down projection's), else the prefetching GEMM, except for
    long rows; beyond, or with the override at 0, the skinny GEMM and the unfused ops (None)."""
    from chattts_velocity.kernels import linear
    from chattts_velocity.kernels._triton.gemv import gemv_triton
    from chattts_velocity.kernels._triton.prefetch_linear import prefetch_linear_triton

    def pick(m: int, n: int, k: int):
        return linear._fetching_kernel(torch.zeros(m, k, dtype=torch.float16), n, k)

    monkeypatch.delenv("CHATTTS_VELOCITY_PREFETCH_ROWS", raising=False)
    monkeypatch.setattr(linear, "prefetch_rows", linear.prefetch_rows.__wrapped__)
    assert linear.prefetch_rows() == linear.PREFETCH_ROWS
    assert pick(1, 2304, 768) is gemv_triton and pick(1, 768, 3072) is gemv_triton
    assert pick(linear.GEMV_ROWS, 2304, 768) is gemv_triton
    assert pick(linear.GEMV_ROWS + 1, 2304, 768) is prefetch_linear_triton
    assert pick(linear.PREFETCH_ROWS, 768, 768) is prefetch_linear_triton
    assert pick(linear.GEMV_ROWS_LONG_K, 768, 3072) is gemv_triton
    assert pick(linear.PREFETCH_ROWS + 1, 2304, 768) is None
    monkeypatch.setenv("CHATTTS_VELOCITY_PREFETCH_ROWS", "16")
    assert pick(12, 2304, 768) is prefetch_linear_triton and pick(12, 768, 3072) is None
    monkeypatch.setenv("CHATTTS_VELOCITY_PREFETCH_ROWS", "0")
    assert pick(2, 2304, 768) is None and pick(1, 2304, 768) is gemv_triton
    monkeypatch.setenv("CHATTTS_VELOCITY_PREFETCH_ROWS", "65")
    with pytest.raises(ValueError, match="CHATTTS_VELOCITY_PREFETCH_ROWS"):
        linear.prefetch_rows()


def test_the_decode_attention_launches_early_where_the_linears_load_their_weights_first(monkeypatch) -> None:
    """The attention (and its merge) under programmatic dependent launch at one row and up to
    ``prefetch_rows()`` rows, so the o projection's weights stream while they run; not beside the skinny GEMMs."""
    from chattts_velocity.kernels import linear
    from chattts_velocity.kernels._triton.decode_attention import launches_early

    monkeypatch.delenv("CHATTTS_VELOCITY_PREFETCH_ROWS", raising=False)
    monkeypatch.setattr(linear, "prefetch_rows", linear.prefetch_rows.__wrapped__)
    assert [launches_early(b) for b in (1, 2, linear.PREFETCH_ROWS, linear.PREFETCH_ROWS + 1, 64)] == [
        True, True, True, False, False]
    monkeypatch.setenv("CHATTTS_VELOCITY_PREFETCH_ROWS", "0")
    assert launches_early(1) and not launches_early(2)
    monkeypatch.setenv("CHATTTS_VELOCITY_PREFETCH_ROWS", "16")
    assert launches_early(16) and not launches_early(17)


def test_one_or_two_rows_launched_early_merge_their_splits_in_the_kernel() -> None:
    """The splitting kernel (early loads, the merge in place) where the batch is small, launched early, split
    by the plan and given counters; otherwise the looping kernel and its merge launch."""
    from chattts_velocity.kernels._triton.decode_attention import merges_in_kernel

    table = 4096
    assert merges_in_kernel(1, True, 256, table, None, True) and merges_in_kernel(2, True, 256, table, None, True)
    assert not merges_in_kernel(4, True, 256, table, None, True)  # the looping kernel was as fast there
    assert not merges_in_kernel(1, False, 256, table, None, True)  # not launched early
    assert not merges_in_kernel(1, True, 256, table, None, False)  # no counters
    assert not merges_in_kernel(1, True, 256, table, 4, True)  # a split count asked for
    assert not merges_in_kernel(1, True, table, table, None, True)  # unsplit


def test_the_decode_attention_splits_by_batch_and_gpu_size() -> None:
    """On a GPU of 132 SMs: 256-token splits on four warps while the batch has fewer than 2 (sequence, head)
    pairs an SM, then one unsplit range a pair on wide one-warp tiles, and from 8 pairs an SM on one-block
    tiles that load their values beside their keys; a given split count keeps 64-token tiles; the interpreter
    (0 SMs) runs 16-token tiles, unsplit with the values early."""
    from chattts_velocity.kernels._triton.decode_attention import split_plan

    table = 4096
    assert split_plan(1, 12, table, None, 132) == (256, 4, 256, False)
    assert split_plan(8, 12, table, None, 132) == (256, 4, 256, False)
    assert split_plan(21, 12, table, None, 132) == (256, 4, 256, False)  # 252 pairs < 264
    assert split_plan(22, 12, table, None, 132) == (128, 1, table, False)
    assert split_plan(87, 12, table, None, 132) == (128, 1, table, False)  # 1,044 pairs < 1,056
    assert split_plan(88, 12, table, None, 132) == (32, 1, table, True)
    assert split_plan(175, 12, table, None, 132) == (32, 1, table, True)  # 2,100 pairs < 2,112
    assert split_plan(176, 12, table, None, 132) == (16, 1, table, True)
    assert split_plan(256, 12, table, None, 132) == (16, 1, table, True)
    assert split_plan(8, 12, table, None, 16) == (128, 1, table, False)  # a small GPU is full sooner
    assert split_plan(2, 12, table, 3, 132) == (64, 4, 1408, False)  # ceil(4096 / 3) up to a 64-token tile
    assert split_plan(2, 4, 100, None, 0) == (16, 4, 100, True)
    assert split_plan(2, 4, 100, 4, 0) == (16, 4, 32, False)
