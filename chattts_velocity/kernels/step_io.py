"""What a graphed decode step does around the layers, in one launch each on Triton instead of ~25 small torch
ops (each a kernel node of the CUDA graph): ``step_inputs`` embeds each row's newest codes and works out its
KV slot, rotary position and context length; ``step_outputs`` records the step's tokens and hidden states and
moves every row's state (tokens, penalty history, step counters, positions) on by one step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dispatch import check, use_triton


def step_inputs(tokens: Tensor, table: Tensor, vocab: int, positions: Tensor, limit: Tensor,
                block_tables: Tensor, block_size: int, max_position: int,
                out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """tokens [B, Q] int64 (each row's newest ids, one per table), table [Q * vocab, H] (the tables stacked),
    positions, limit [B] int64, block_tables [B, W] int32 -> emb [B, H] ``out_dtype`` (the Q rows summed in
    float32, in order), slots [B] int64 (-1 at positions >= limit: no KV write), rotary positions [B] int64
    (clamped to the table) and context lengths [B] int32 (rotary position + 1)."""
    check(tokens.dim() == 2 and tokens.stride(1) == 1 and table.dim() == 2 and table.is_contiguous(),
          "tokens must be [B, Q] with contiguous rows, table a contiguous [Q * vocab, H]")
    if use_triton(tokens):
        from ._triton.step_io import step_inputs_triton

        return step_inputs_triton(tokens, table, vocab, positions, limit, block_tables, block_size,
                                  max_position, out_dtype)
    return step_inputs_ref(tokens, table, vocab, positions, limit, block_tables, block_size, max_position,
                           out_dtype)


def step_inputs_ref(tokens: Tensor, table: Tensor, vocab: int, positions: Tensor, limit: Tensor,
                    block_tables: Tensor, block_size: int, max_position: int,
                    out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Torch reference of ``step_inputs`` (the CPU path)."""
    offsets = torch.arange(tokens.size(1), device=tokens.device) * vocab
    emb = F.embedding(tokens + offsets, table).sum(1).to(out_dtype)  # the codebooks' sum, as embed_codes has it
    blocks = block_tables.gather(1, (positions // block_size).clamp(max=block_tables.size(1) - 1)[:, None])[:, 0]
    slots = torch.where(positions < limit, blocks.to(torch.int64) * block_size + positions % block_size, -1)
    rope = positions.clamp(max=max_position - 1)
    return emb, slots, rope, (rope + 1).to(torch.int32)


def step_outputs(step_tokens: Tensor, flat_tokens: Tensor, hidden: Tensor, out_tokens: Tensor, out_hidden: Tensor,
                 step_out: Tensor, tokens: Tensor, history: Tensor, step: Tensor, positions: Tensor) -> None:
    """In place, for B = len(step_tokens) rows and R = len(flat_tokens) sampling rows (B * Q for audio, B for
    text, where step_tokens repeats each row's token over the Q columns): out_tokens[step_out, :B] and tokens[:B]
    = step_tokens [B, Q] int64; out_hidden[step_out, :B] = hidden [B, H] float32; history[:R] slides by one,
    flat_tokens [R] newest; step[:R] += 1; positions[:B] += 1. ``step_out`` [] int64 is read on the device."""
    check(flat_tokens.size(0) % step_tokens.size(0) == 0 and hidden.is_contiguous() and tokens.is_contiguous()
          and history.stride(1) == 1 and out_tokens.is_contiguous() and out_hidden.is_contiguous(),
          "step_outputs: R must be a multiple of B; hidden, tokens, out_* contiguous, history rows contiguous")
    if use_triton(step_tokens):
        from ._triton.step_io import step_outputs_triton

        step_outputs_triton(step_tokens, flat_tokens, hidden, out_tokens, out_hidden, step_out, tokens, history,
                            step, positions)
        return
    step_outputs_ref(step_tokens, flat_tokens, hidden, out_tokens, out_hidden, step_out, tokens, history, step,
                     positions)


def step_outputs_ref(step_tokens: Tensor, flat_tokens: Tensor, hidden: Tensor, out_tokens: Tensor,
                     out_hidden: Tensor, step_out: Tensor, tokens: Tensor, history: Tensor, step: Tensor,
                     positions: Tensor) -> None:
    """Torch reference of ``step_outputs`` (the CPU path)."""
    b, r = step_tokens.size(0), flat_tokens.size(0)
    out_tokens[:, :b].index_copy_(0, step_out[None], step_tokens[None])
    out_hidden[:, :b].index_copy_(0, step_out[None], hidden[None])
    tokens[:b].copy_(step_tokens)
    history[:r].copy_(torch.cat([history[:r, 1:], flat_tokens[:, None]], 1))
    step[:r] += 1
    positions[:b] += 1
