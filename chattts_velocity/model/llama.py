"""The engine's Llama core: the ChatTTS GPT's 20 layers over a paged KV cache, as a flat batch of tokens.

Weights are taken from the transformers ``LlamaModel`` (q/k/v and gate/up fused into one matrix each, so a layer
is four GEMMs). Every op comes from ``chattts_velocity.kernels``: Triton on CUDA (a small decode batch's GEMMs
too, fused with the norms and the SwiGLU gate; cuBLAS for larger batches), the torch reference on CPU. Inputs
are embeddings (ChatTTS builds them from codes, text ids and the speaker vector).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import kernels


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache. N tokens of S sequences, flattened."""

    positions: Tensor
    """[N] int64: position of each token in its sequence."""
    slot_mapping: Tensor
    """[N] int64: cache slot (block * block_size + offset) each token's K/V is written to."""
    cu_seqlens_q: Tensor
    """[S + 1] int32: token offsets of the sequences in the flat batch."""
    context_lens: Tensor
    """[S] int32: cached tokens of each sequence after this step (prefix + new)."""
    block_tables: Tensor
    """[S, max_blocks] int32."""
    decode_only: bool
    """Every sequence computes exactly one token (pure decode step)."""


@dataclass
class _Layer:
    input_norm: Tensor
    qkv: Tensor  # [(Hq + 2 Hk) * D, H]
    o: Tensor  # [H, Hq * D]
    post_norm: Tensor
    gate_up: Tensor  # [2 I, H]
    down: Tensor  # [H, I]


def _fused(linears: list[torch.nn.Linear], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The linears' weights stacked into one [sum N_i, K] matrix. Where the model holds them in the core's dtype
    on its device, the linears' weights become views of that matrix, so they are held once (the other weights,
    taken as they are, are shared already): 495 MiB less for the full-size model in float32."""
    fused = torch.cat([m.weight.detach() for m in linears]).to(device=device, dtype=dtype).contiguous()
    if all(m.weight.dtype == fused.dtype and m.weight.device == fused.device for m in linears):
        row = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight = torch.nn.Parameter(fused[row : row + n], requires_grad=m.weight.requires_grad)
            row += n
    return fused


class LlamaCore:
    def __init__(self, llama, dtype: torch.dtype, device: torch.device):
        cfg = llama.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.dtype = dtype

        def w(t: Tensor) -> Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        self.layers = []
        for layer in llama.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                input_norm=w(layer.input_layernorm.weight),
                qkv=_fused([att.q_proj, att.k_proj, att.v_proj], dtype, device),
                o=w(att.o_proj.weight),
                post_norm=w(layer.post_attention_layernorm.weight),
                gate_up=_fused([mlp.gate_proj, mlp.up_proj], dtype, device),
                down=w(mlp.down_proj.weight),
            ))
        self.norm = w(llama.norm.weight)
        theta = cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta
        self.cos_sin = kernels.rotary_cos_sin_cache(self.head_dim, cfg.max_position_embeddings, theta, device)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, x: Tensor, meta: AttentionMetadata, kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """x [N, H] input embeddings -> final-norm hidden states [N, H] (core dtype)."""
        x = x.to(self.dtype)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            # each fused_linear is one Triton launch for a small decode batch (norm and gate included)
            if residual is None:
                qkv, residual = kernels.fused_linear(x, layer.qkv, norm_weight=layer.input_norm, eps=self.eps), x
            else:
                qkv, residual = kernels.fused_linear(x, layer.qkv, norm_weight=layer.input_norm, eps=self.eps,
                                                     residual=residual)
            x = kernels.fused_linear(self._attention(qkv, meta, k_cache, v_cache), layer.o)
            h, residual = kernels.fused_linear(x, layer.gate_up, norm_weight=layer.post_norm, eps=self.eps,
                                               residual=residual, gated=True)
            x = kernels.fused_linear(h, layer.down)
        h, _ = kernels.rms_norm(x, self.norm, self.eps, residual)
        return h

    def _attention(self, qkv: Tensor, meta: AttentionMetadata, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """qkv [N, q + 2 kv] projections -> attention output [N, q] (before the o projection)."""
        n = qkv.size(0)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_size].reshape(n, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(n, self.num_kv_heads, self.head_dim)
        # q, k, v stay strided views of qkv: the kernels take any row stride, so no per-layer copies
        kernels.rotary_store_kv(q, k, v, meta.positions, self.cos_sin, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            out = kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                 self.scale)
        else:
            out = kernels.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                                  meta.context_lens, self.scale)
        return out.reshape(n, q_size)
