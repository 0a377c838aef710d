"""``BlockSpaceManager``: the paged KV cache's blocks: block tables, reference counts, an LRU free pool, a
watermark, and prefix caching by content hash.

A block's key chains the previous block's key with the block's content: the ids of all codebooks and the
text/audio flag of every position, and (first block) the speaker digest. Two prompts with equal text ids but
different speakers or voice samples share nothing. Freed blocks keep their key until the pool hands them out
again, so a later request (or a preempted one coming back) can reuse them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from .sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.key: bytes | None = None


def block_key(parent: bytes, tokens, is_text, speaker_key: bytes) -> bytes:
    """Content key of one full block: chained on ``parent`` (b"" for the first block, which adds the speaker);
    ``tokens`` [block_size, num_vq] ids (an array, or ``Token``s)."""
    h = hashlib.blake2b(parent or speaker_key, digest_size=16)
    h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    h.update(bytes(is_text))
    return h.digest()


class BlockSpaceManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_pool: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        """Blocks with no reference, least recently freed first (the first to be reused)."""
        self.cached: dict[bytes, int] = {}
        """Content key -> block holding that content (in use or still in the free pool)."""
        self.num_hit_blocks = 0
        """Blocks reused from the prefix cache so far (a metric)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_pool)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- prefix cache
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding a prefix of ``seq``. At least one token is left to compute, so the step that
        resumes the sequence produces the logits of its next token."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i in range((len(seq) - 1) // self.block_size):
            block_id = self.cached.get(self._key(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _key(self, seq: Sequence, i: int) -> bytes:
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            span = slice(j * self.block_size, (j + 1) * self.block_size)
            parent = seq.block_hashes[-1] if j else b""
            rows = seq.tokens.rows(span.start, span.stop)
            seq.block_hashes.append(block_key(parent, rows, seq.is_text[span], seq.speaker_key))
        return seq.block_hashes[i]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` whose tokens are all computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_cached_blocks, full):
            block = self.blocks[seq.block_table[i]]
            key = self._key(seq, i)
            if block.key is None and key not in self.cached:  # an equal block of the same step: first one wins
                self.cached[key] = block.block_id
                block.key = key
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    # ---------------------------------------------------------------- allocation
    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = (), watermark: bool = False) -> bool:
        """Whether ``num_new_tokens`` more tokens of ``seq`` (after ``hits``, for a sequence being admitted)
        fit; admissions keep ``watermark_blocks`` free so running sequences can still grow."""
        held = len(seq.block_table) or len(hits)
        computed = seq.num_computed_tokens or len(hits) * self.block_size
        needed = self.blocks_for(computed + num_new_tokens) - held
        needed += sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits still in the free pool
        reserve = self.watermark_blocks if watermark else 0
        return self.num_free_blocks - needed >= reserve

    def allocate_together(self, seqs: list[Sequence], counts: list[int]) -> bool:
        """Blocks for ``counts[i]`` more tokens of each ``seqs[i]`` past its computed ones, all or none: False,
        with nothing allocated, when the free pool cannot hold them all (a decode window's reservation)."""
        needed = sum(max(self.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table), 0)
                     for seq, n in zip(seqs, counts, strict=True))
        if needed > self.num_free_blocks:
            return False
        for seq, n in zip(seqs, counts, strict=True):
            self.allocate(seq, n)
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = ()) -> None:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more tokens; ``hits`` (prefix-cache blocks from
        ``lookup_prefix``) start the table of a sequence being admitted and count as computed."""
        if hits:
            assert not seq.block_table, "prefix hits only start an empty block table"
            for block_id in hits:
                self._ref(block_id)
            seq.block_table = list(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_cached_blocks = len(hits)
            self.num_hit_blocks += len(hits)
        for _ in range(self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, last block first, so that its prefix outlives its tail in the pool."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_pool[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_pool[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free_pool.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key = None
        block.ref_count = 1
        return block_id
