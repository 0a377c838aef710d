"""Block-table addressing shared by the paged attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_offsets(block_table_row, tokens, mask, kv_head_offset, row_stride, BLOCK_SIZE: tl.constexpr):
    """Element offsets of ``tokens`` [T] of one sequence in a [num_blocks, BLOCK_SIZE, Hk, D] cache, at the
    start of the head at ``kv_head_offset``. Masked tokens get block 0 and must not be dereferenced; an unused
    entry (negative) reads as block 0, so a token past its context still addresses the cache."""
    blocks = tl.maximum(tl.load(block_table_row + tokens // BLOCK_SIZE, mask=mask, other=0), 0).to(tl.int64)
    return (blocks * BLOCK_SIZE + tokens % BLOCK_SIZE) * row_stride + kv_head_offset  # [T]
