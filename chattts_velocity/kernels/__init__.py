"""The Llama-core ops of the paged-KV engine: Triton kernels on CUDA, torch references on CPU.

Each op has a checked public launcher and a ``*_ref`` torch reference (the CPU path and the tests' oracle).
Triton is imported only when an op runs on it, so ``import chattts_velocity.kernels`` needs neither triton nor
a GPU; set ``TRITON_INTERPRET=1`` before the first op runs to send CPU tensors through the Triton interpreter.
"""

from __future__ import annotations

from ._dispatch import use_triton
from .activation import silu_and_mul, silu_and_mul_ref
from .attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from .kv_cache import store_kv, store_kv_ref
from .linear import (
    MAX_FUSED_ROWS,
    fused_linear,
    fused_linear_ref,
    fused_qkv_rotary_store,
    fused_qkv_rotary_store_ref,
)
from .norm import rms_norm, rms_norm_ref
from .rotary import (
    apply_rotary,
    apply_rotary_ref,
    rotary_cos_sin_cache,
    rotary_store_kv,
    rotary_store_kv_ref,
)
from .sampling import sample_rows_fused, sample_rows_fused_ref
from .step_io import step_inputs, step_inputs_ref, step_outputs, step_outputs_ref

__all__ = [
    "MAX_FUSED_ROWS",
    "fused_linear",
    "fused_linear_ref",
    "fused_qkv_rotary_store",
    "fused_qkv_rotary_store_ref",
    "apply_rotary",
    "apply_rotary_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_cos_sin_cache",
    "rotary_store_kv",
    "rotary_store_kv_ref",
    "sample_rows_fused",
    "sample_rows_fused_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "step_inputs",
    "step_inputs_ref",
    "step_outputs",
    "step_outputs_ref",
    "store_kv",
    "store_kv_ref",
    "use_triton",
]
