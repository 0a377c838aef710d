"""The decode step's inputs and outputs around the layers, one launch each (see ``kernels/step_io.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _step_inputs_kernel(tokens_ptr, tok_stride, table_ptr, positions_ptr, limit_ptr, tables_ptr, bt_stride,
                        emb_ptr, slots_ptr, rope_ptr, ctx_ptr, vocab, width, max_position,
                        H: tl.constexpr, H_PAD: tl.constexpr, Q: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    b = tl.program_id(0)
    pos = tl.load(positions_ptr + b)
    block = tl.load(tables_ptr + b.to(tl.int64) * bt_stride + tl.minimum(pos // BLOCK_SIZE, width - 1))
    slot = tl.where(pos < tl.load(limit_ptr + b), block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    rope = tl.minimum(pos, max_position - 1)
    tl.store(slots_ptr + b, slot)
    tl.store(rope_ptr + b, rope)
    tl.store(ctx_ptr + b, (rope + 1).to(tl.int32))
    hs = tl.arange(0, H_PAD)
    acc = tl.zeros([H_PAD], tl.float32)
    for q in tl.static_range(Q):  # the codebooks in order, as the embedding's sum adds them
        row = q * vocab + tl.load(tokens_ptr + b.to(tl.int64) * tok_stride + q)
        acc += tl.load(table_ptr + row * H + hs, mask=hs < H, other=0.0).to(tl.float32)
    tl.store(emb_ptr + b.to(tl.int64) * H + hs, acc.to(emb_ptr.dtype.element_ty), mask=hs < H)


def step_inputs_triton(tokens: Tensor, table: Tensor, vocab: int, positions: Tensor, limit: Tensor,
                       block_tables: Tensor, block_size: int, max_position: int, out_dtype: torch.dtype):
    batch, q = tokens.shape
    hidden = table.shape[1]
    dev = tokens.device
    emb = torch.empty(batch, hidden, dtype=out_dtype, device=dev)
    slots, rope = torch.empty(batch, dtype=torch.int64, device=dev), torch.empty(batch, dtype=torch.int64, device=dev)
    ctx = torch.empty(batch, dtype=torch.int32, device=dev)
    _step_inputs_kernel[(batch,)](tokens, tokens.stride(0), table, positions, limit, block_tables,
                                  block_tables.stride(0), emb, slots, rope, ctx, vocab, block_tables.shape[1],
                                  max_position, H=hidden, H_PAD=triton.next_power_of_2(hidden), Q=q,
                                  BLOCK_SIZE=block_size, num_warps=4)
    return emb, slots, rope, ctx


@triton.jit
def _step_outputs_kernel(step_tokens_ptr, st_stride0, st_stride1, flat_ptr, hidden_ptr, out_tokens_ptr,
                         out_hidden_ptr, step_out_ptr, tokens_ptr, history_ptr, step_ptr, positions_ptr,
                         out_tok_stride, out_hid_stride, hist_stride, width,
                         H: tl.constexpr, H_PAD: tl.constexpr, Q: tl.constexpr, LANES: tl.constexpr,
                         W_PAD: tl.constexpr):
    b = tl.program_id(0)
    k = tl.load(step_out_ptr)
    qs = tl.arange(0, Q)
    toks = tl.load(step_tokens_ptr + b * st_stride0 + qs * st_stride1)
    tl.store(out_tokens_ptr + k * out_tok_stride + b * Q + qs, toks)
    tl.store(tokens_ptr + b * Q + qs, toks)
    hs = tl.arange(0, H_PAD)
    h = tl.load(hidden_ptr + b.to(tl.int64) * H + hs, mask=hs < H)
    tl.store(out_hidden_ptr + k * out_hid_stride + b.to(tl.int64) * H + hs, h, mask=hs < H)
    tl.store(positions_ptr + b, tl.load(positions_ptr + b) + 1)
    ws = tl.arange(0, W_PAD)
    for lane in tl.static_range(LANES):  # this sequence's sampling rows: the history slides by one
        row = b * LANES + lane
        base = history_ptr + row.to(tl.int64) * hist_stride
        kept = tl.load(base + ws + 1, mask=ws < width - 1)
        newest = tl.load(flat_ptr + row)
        tl.debug_barrier()  # every thread has read the row before any overwrites it
        tl.store(base + ws, tl.where(ws == width - 1, newest, kept), mask=ws < width)
        tl.store(step_ptr + row, tl.load(step_ptr + row) + 1)


def step_outputs_triton(step_tokens: Tensor, flat_tokens: Tensor, hidden: Tensor, out_tokens: Tensor,
                        out_hidden: Tensor, step_out: Tensor, tokens: Tensor, history: Tensor, step: Tensor,
                        positions: Tensor) -> None:
    batch, q = step_tokens.shape
    hidden_size, width = hidden.shape[1], history.shape[1]
    _step_outputs_kernel[(batch,)](
        step_tokens, step_tokens.stride(0), step_tokens.stride(1), flat_tokens, hidden, out_tokens, out_hidden,
        step_out, tokens, history, step, positions, out_tokens.stride(0), out_hidden.stride(0), history.stride(0),
        width, H=hidden_size, H_PAD=triton.next_power_of_2(hidden_size), Q=q,
        LANES=flat_tokens.shape[0] // batch, W_PAD=triton.next_power_of_2(width), num_warps=4)
