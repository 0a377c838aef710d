"""The CPU engine's decode-step ops (``kernels/decode_cpu.py``, ``WindowSampler``, ``Embed.embed_codes``) give the
torch references' results bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chattts_velocity import kernels as K
from chattts_velocity.kernels import decode_cpu
from chattts_velocity.kernels.linear import CPU_WEIGHT_FORMATS, CpuWeight
from chattts_velocity.kernels.sampling import sample_rows_fused_ref
from chattts_velocity.kernels.sampling_cpu import WindowSampler
from chattts_velocity.kernels.sampling_hash import row_hash, uniform_at, uniform_from_hash
from chattts_velocity.model.embed import Embed

BLOCK = 4


def _cache(gen: torch.Generator, blocks: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen) for _ in range(2))


@pytest.mark.parametrize("dense_bytes", [decode_cpu.DENSE_KV_BYTES, 0])
def test_decode_window_layers_equal_the_references_bit_for_bit(dense_bytes, monkeypatch):
    """With the layers' dense K/V copies kept across the steps, and (over the budget) gathered every step."""
    monkeypatch.setattr(decode_cpu, "DENSE_KV_BYTES", dense_bytes)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, steps = 4, 2, 16, 3
    k_cache, v_cache = _cache(gen, 16, kv_heads, dim)
    tables = torch.tensor([[3, 7, 1, -1], [5, 0, -1, -1], [9, 2, 11, 4]], dtype=torch.int32)
    first, limits = [6, 2, 12], [100, 4, 100]  # sequence 1 runs past its limit: no KV write there
    positions = [[p + j for p in first] for j in range(steps)]
    slots = [[int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK if p < limits[i] else -1 for i, p in enumerate(pos)]
             for pos in positions]
    cos_sin = K.rotary_cos_sin_cache(dim, 64, 10000.0, "cpu")
    window = decode_cpu.DecodeWindow(positions, slots, tables, cos_sin, BLOCK, dim**-0.5)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    for j in range(steps):
        qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen)
        q = qkv[:, : heads * dim].reshape(3, heads, dim).clone()
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(3, kv_heads, dim).clone()
        v = qkv[:, (heads + kv_heads) * dim :].reshape(3, kv_heads, dim).clone()
        pos, slot = torch.tensor(positions[j]), torch.tensor(slots[j])
        K.rotary_store_kv_ref(q, k, v, pos, cos_sin, ref_k, ref_v, slot)
        expected = K.paged_decode_attention_ref(q, ref_k, ref_v, tables, (pos + 1).to(torch.int32), dim**-0.5)
        ctx = window.context(j)
        rotated = decode_cpu.rotary_store_kv_cpu(qkv, heads, kv_heads, ctx, k_cache, v_cache)
        assert torch.equal(rotated, q)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
        assert torch.equal(decode_cpu.decode_attention_cpu(rotated, k_cache, v_cache, ctx), expected)
    assert len(window._kv) == (1 if dense_bytes else 0)  # the copy kept, or none


def test_linear_cpu_equals_fused_linear_ref_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    eps = 1e-5
    for rows in (1, 5):
        x, residual = torch.randn(rows, 64, generator=gen), torch.randn(rows, 64, generator=gen)
        norm = 1 + 0.1 * torch.randn(64, generator=gen)
        for out, gated in ((192, False), (256, True)):
            weight = torch.randn(out, 64, generator=gen)
            kw = dict(norm_weight=norm, residual=residual, gated=gated)
            expected = K.fused_linear_ref(x, weight, eps=eps, **kw)
            got = decode_cpu.linear_cpu(x, weight, eps=torch.tensor(eps), **kw)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert torch.equal(decode_cpu.linear_cpu(x, weight), K.fused_linear_ref(x, weight))
        assert torch.equal(decode_cpu.rms_norm_cpu(x, norm, torch.tensor(eps)), K.rms_norm_ref(x, norm, eps))


@pytest.mark.parametrize("fmt", CPU_WEIGHT_FORMATS)
def test_linear_cpu_with_a_cpu_weight_equals_fused_linear_ref_bit_for_bit(fmt):
    """The CPU engine dtypes' matrices: the decode step's unchecked linear and the checked reference (the prefill
    path) run the same kernel around the same norm and gate."""
    gen = torch.Generator().manual_seed(2)
    eps = 1e-5
    for rows in (1, 5):
        x, residual = torch.randn(rows, 64, generator=gen), torch.randn(rows, 64, generator=gen)
        norm = 1 + 0.1 * torch.randn(64, generator=gen)
        for out, gated in ((192, False), (256, True)):
            weight = CpuWeight(torch.randn(out, 64, generator=gen) * 0.1, fmt)
            kw = dict(norm_weight=norm, residual=residual, gated=gated)
            expected = K.fused_linear_ref(x, weight, eps=eps, **kw)
            got = decode_cpu.linear_cpu(x, weight, eps=torch.tensor(eps), **kw)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
            assert torch.equal(K.fused_linear(x, weight, eps=eps, **kw)[0], expected[0])
        assert torch.equal(decode_cpu.linear_cpu(x, weight), K.fused_linear_ref(x, weight))
        assert torch.equal(decode_cpu.linear_cpu(x, weight), weight(x))


@pytest.mark.parametrize("way", ["chain", "partition", "few"])
def test_window_sampler_equals_the_reference_chain_step_by_step(way, monkeypatch):
    """Every way of sampling: the whole chain (a row without top-k); among each row's top-k candidates (every
    row's top_k <= MAX_CANDIDATES), from a partition, and for peaked rows from their few largest logits; a tie
    at the C-th largest logit falls back to the chain."""
    ran = {"few": 0, "partition": 0}
    few, partition = WindowSampler._few_largest, WindowSampler._c_largest

    def spy(name, method):
        def call(self, *args):
            out = method(self, *args)
            ran[name] += out is not None
            return out
        return call

    monkeypatch.setattr(WindowSampler, "_few_largest", spy("few", few))
    monkeypatch.setattr(WindowSampler, "_c_largest", spy("partition", partition))
    candidates = way != "chain"
    gen = torch.Generator().manual_seed(2)
    rows, vocab, width, steps, eos = 6, 50, 8, 6, 49
    params = dict(
        temperature=torch.tensor([[0.3], [1.0], [0.7], [1e-5], [1.0], [0.5]]),
        top_p=torch.tensor([[0.7], [0.8], [0.9], [0.5], [0.5], [0.95]] if way == "few"  # top-p on: 3 kept
                           else [[0.7], [1.0], [0.9], [1.0], [0.5], [1.0]]),
        top_k=torch.tensor([20, 7, 5, 9, 3, 2] if candidates else [20, 1 << 30, 5, 1 << 30, 3, 2]),
        penalty=torch.tensor([[1.05], [1.0], [1.3], [1.0], [2.0], [1.0]]),
        window=torch.tensor([8, 8, 3, 8, 0, 5]),
        min_new=torch.tensor([0, 3, 10, 2, 0, 1]),  # bans EOS for some rows in some steps
        seed=torch.tensor([1, 2, 3, 4, 5, -7]),
        step=torch.tensor([0, 1, 2, 0, 7, 0]),
        lane=torch.tensor([0, 1, 2, 3, 0, 1]),
    )
    history = torch.full((rows, width + steps), -1, dtype=torch.int64)
    history[:, width - 3 : width] = torch.randint(0, vocab, (rows, 3), generator=gen)
    for penalised in (True, False):
        if not penalised:
            params["penalty"] = torch.ones(rows, 1)
        sample = WindowSampler(**params, eos_id=eos, vocab=vocab, width=width, num_steps=steps)
        assert sample.fast is candidates
        for j in range(steps):
            logits = torch.randn(rows, vocab, generator=gen) * (12 if way == "few" else 1)
            if j == steps - 1:  # a tie at the 20th largest logit of row 0: more than 20 ids at or above it
                top = logits[0].topk(21).values
                logits[0][logits[0] == top[19]] = top[20]
            step = params["step"] + j
            hist = history[:, j : j + width]
            expected = sample_rows_fused_ref(logits, **{**params, "step": step}, history=hist.contiguous(),
                                             eos_id=eos)
            got = sample(logits, hist, j)
            assert torch.equal(got, expected)
            history[:, width + j] = got
    if way == "few":
        assert ran["few"] >= steps  # most steps settled by the few largest
    elif way == "partition":
        assert ran == {"few": 0, "partition": 2 * (steps - 1)}  # the last step of each: the tie, the chain


def test_uniforms_at_some_ids_are_the_whole_rows_uniforms_there():
    hashes = row_hash(np.array([3, -1, 1 << 40]), np.array([0, 5, 9]), np.array([0, 1, 3]))
    columns = np.array([[0, 5, 625], [17, 17, 2], [400, 1, 0]])
    whole = uniform_from_hash(hashes, 626)
    assert np.array_equal(uniform_at(hashes, columns, 626), np.take_along_axis(whole, columns, 1))


def test_embed_codes_equals_embed_step_bit_for_bit():
    torch.manual_seed(3)
    embed = Embed(hidden_size=32, num_audio_tokens=20, num_text_tokens=30)
    ids = torch.randint(0, 20, (5, 4))
    expected = embed.embed_step(ids[:, None], text_mode=False)[:, 0]
    with torch.no_grad():
        table, offsets = embed.fuse_code_tables()
    assert torch.equal(embed.embed_codes(ids, table, offsets), expected)
    assert torch.equal(embed.embed_step(ids[:, None], text_mode=False)[:, 0], expected)  # views: same weights


def test_embed_rows_equals_forward_bit_for_bit():
    """The prefill steps' embeddings (text and audio rows given as indices, audio through the fused table)
    are ``Embed.forward``'s (boolean masks) bit for bit, for text-only, audio-only and mixed inputs."""
    torch.manual_seed(4)
    embed = Embed(hidden_size=32, num_audio_tokens=20, num_text_tokens=30)
    with torch.no_grad():
        table, offsets = embed.fuse_code_tables()
    for mask in ([True] * 6, [False] * 6, [True, False, False, True, True, False]):
        is_text = torch.tensor(mask)
        ids = torch.randint(0, 20, (6, 4))
        ids[is_text] = torch.randint(0, 30, (int(is_text.sum()), 1)).expand(-1, 4)  # text ids repeat
        text_rows, code_rows = is_text.nonzero()[:, 0], (~is_text).nonzero()[:, 0]
        expected = embed(ids[None], is_text[None])[0]
        assert torch.equal(embed.embed_rows(ids, text_rows, code_rows, table, offsets), expected)
