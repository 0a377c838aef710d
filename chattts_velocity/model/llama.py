"""The engine's Llama core: the ChatTTS GPT's 20 layers over a paged KV cache, as a flat batch of tokens.

Weights are taken from the transformers ``LlamaModel`` (q/k/v and gate/up fused into one matrix each, so a layer
is four GEMMs). Every op comes from ``chattts_velocity.kernels``: Triton on CUDA (a small decode batch's GEMMs
too, fused with the norms and the SwiGLU gate; cuBLAS for larger batches), the torch reference on CPU, where
the four matrices may be ``CpuWeight``s (float16, bfloat16 or int8, prepacked for their CPU kernel) while the
activations, norms and KV cache keep the core's dtype. Inputs are embeddings (ChatTTS builds them from codes,
text ids and the speaker vector).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import kernels
from ..kernels import decode_cpu
from ..kernels.linear import CpuWeight
from .stacked import stacked_weights


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
    split_counters: Tensor | None = None
    """[>= S * Hq] int32 zeros of the decode attention's in-kernel merge (``kernels.paged_decode_attention``);
    None merges split contexts in a launch of their own."""


@dataclass
class _Layer:
    input_norm: Tensor
    qkv: Tensor | CpuWeight  # [(Hq + 2 Hk) * D, H]
    o: Tensor | CpuWeight  # [H, Hq * D]
    post_norm: Tensor
    gate_up: Tensor | CpuWeight  # [2 I, H]
    down: Tensor | CpuWeight  # [H, I]


class LlamaCore:
    def __init__(self, llama, dtype: torch.dtype, device: torch.device, weights: str | None = None):
        """The core in ``dtype`` on ``device``; ``weights``: a ``CpuWeight`` format for the four matrices of
        every layer (CPU only), None: the matrices in ``dtype`` too."""
        if weights is not None and torch.device(device).type != "cpu":
            raise ValueError(f"weights={weights!r} is a CPU weight format; on {device} the matrices take the "
                             "core's dtype (weights=None)")
        cfg = llama.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.dtype = dtype
        self.weights = weights

        def w(t: Tensor) -> Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        def matrix(modules: list) -> Tensor | CpuWeight:
            if weights is None:
                return stacked_weights(modules, dtype, device) if len(modules) > 1 else w(modules[0].weight)
            return CpuWeight(torch.cat([m.weight.detach() for m in modules]), weights)

        self.layers = []
        for layer in llama.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                input_norm=w(layer.input_layernorm.weight),
                qkv=matrix([att.q_proj, att.k_proj, att.v_proj]),
                o=matrix([att.o_proj]),
                post_norm=w(layer.post_attention_layernorm.weight),
                gate_up=matrix([mlp.gate_proj, mlp.up_proj]),
                down=matrix([mlp.down_proj]),
            ))
        self.norm = w(llama.norm.weight)
        theta = cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta
        self.cos_sin = kernels.rotary_cos_sin_cache(self.head_dim, cfg.max_position_embeddings, theta, device)
        self.triton = kernels.use_triton(self.norm)
        self.eps_tensor = torch.tensor(self.eps, dtype=torch.float32)  # the CPU decode step's

    def shares_weights(self, llama) -> bool:
        """Whether the core's matrices are the transformers ``llama``'s own storage (same dtype and device),
        so that letting the Llama's weights go would free nothing."""
        if self.weights is not None:
            return False
        ours = self.layers[0].o.untyped_storage().data_ptr()
        return ours == llama.layers[0].self_attn.o_proj.weight.untyped_storage().data_ptr()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def decode_window(self, positions: list[list[int]], slots: list[list[int]], block_tables: Tensor,
                      block_size: int) -> decode_cpu.DecodeWindow:
        """The contexts of a CPU decode window's steps (``DecodeWindow``), to pass ``forward`` as its ``meta``."""
        return decode_cpu.DecodeWindow(positions, slots, block_tables, self.cos_sin, block_size, self.scale)

    def forward(self, x: Tensor, meta: AttentionMetadata | decode_cpu.DecodeContext,
                kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """x [N, H] input embeddings -> final-norm hidden states [N, H] (core dtype). On CPU a decode step's
        ``meta`` may be its precomputed ``DecodeContext`` (a CPU decode step builds one otherwise): its layers
        run the unchecked torch references with the work they share done once."""
        x = x.to(self.dtype)
        cpu = meta if isinstance(meta, decode_cpu.DecodeContext) else None
        if cpu is None and meta.decode_only and not self.triton:
            cpu = self.decode_window([meta.positions.tolist()], [meta.slot_mapping.tolist()], meta.block_tables,
                                     kv_caches[0][0].size(1)).context(0)
        linear, norm, eps = kernels.fused_linear, kernels.rms_norm, self.eps
        if cpu is not None:
            linear, norm, eps = decode_cpu.linear_cpu, decode_cpu.rms_norm_cpu, self.eps_tensor
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            # each fused op is one Triton launch for a small decode batch (norm, gate, rotary included)
            if cpu is not None:
                if residual is None:
                    qkv, residual = linear(x, layer.qkv, norm_weight=layer.input_norm, eps=eps), x
                else:
                    qkv, residual = linear(x, layer.qkv, norm_weight=layer.input_norm, eps=eps, residual=residual)
                attn = self._attention_cpu(qkv, cpu, k_cache, v_cache)
            else:
                qkv, new_residual = kernels.fused_qkv_rotary_store(
                    x, layer.qkv, norm_weight=layer.input_norm, eps=eps, residual=residual,
                    positions=meta.positions, cos_sin_cache=self.cos_sin, k_cache=k_cache, v_cache=v_cache,
                    slot_mapping=meta.slot_mapping, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
                residual = x if residual is None else new_residual
                attn = self._attention(qkv, meta, k_cache, v_cache)
            x = linear(attn, layer.o)
            h, residual = linear(x, layer.gate_up, norm_weight=layer.post_norm, eps=eps, residual=residual,
                                 gated=True)
            x = linear(h, layer.down)
        h, _ = norm(x, self.norm, eps, residual)
        return h

    def _attention(self, qkv: Tensor, meta: AttentionMetadata, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """qkv [N, q + 2 kv] projections, q rotated and k/v already in the cache -> attention output [N, q]
        (before the o projection)."""
        n, q_size = qkv.size(0), self.num_heads * self.head_dim
        # q stays a strided view of qkv: the kernels take any row stride, so no per-layer copy
        q = qkv[:, :q_size].reshape(n, self.num_heads, self.head_dim)
        if meta.decode_only:
            out = kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                 self.scale, split_counters=meta.split_counters)
        else:
            out = kernels.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                                  meta.context_lens, self.scale)
        return out.reshape(n, q_size)

    def _attention_cpu(self, qkv: Tensor, cpu: decode_cpu.DecodeContext, k_cache: Tensor,
                       v_cache: Tensor) -> Tensor:
        """The CPU decode step's rotary, KV write and attention, with the window's shared work done once."""
        n, q_size = qkv.size(0), self.num_heads * self.head_dim
        q = decode_cpu.rotary_store_kv_cpu(qkv, self.num_heads, self.num_kv_heads, cpu, k_cache, v_cache)
        return decode_cpu.decode_attention_cpu(q, k_cache, v_cache, cpu).reshape(n, q_size)
