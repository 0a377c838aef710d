"""BlockSpaceManager: exact block ids, reference counts, the LRU free pool, the watermark and prefix caching."""

from __future__ import annotations

import pytest
from engine_helpers import make_seq

from chattts_velocity.engine.block_manager import BlockSpaceManager


def compute(bm: BlockSpaceManager, seq, n: int) -> None:
    """Allocate and mark ``n`` more tokens of ``seq`` computed, as one engine step does."""
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_allocate_takes_lowest_free_blocks_and_free_returns_them_last_first():
    bm = BlockSpaceManager(num_blocks=8, block_size=4)
    a, b = make_seq(6), make_seq(9, first=100)
    compute(bm, a, 6)
    compute(bm, b, 9)
    assert a.block_table == [0, 1]
    assert b.block_table == [2, 3, 4]
    assert bm.num_free_blocks == 3
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    # freed tail first, so the prefix block 0 stays cached longest
    assert list(bm.free_pool) == [5, 6, 7, 1, 0]


def test_decode_growth_allocates_a_block_only_at_a_block_boundary():
    bm = BlockSpaceManager(num_blocks=4, block_size=4)
    seq = make_seq(3)
    compute(bm, seq, 3)
    assert seq.block_table == [0]
    seq.extend([(7,) * 4])  # token 4 fits block 0
    compute(bm, seq, 1)
    assert seq.block_table == [0]
    seq.extend([(8,) * 4])  # token 5 needs block 1
    assert bm.can_allocate(seq, 1)
    compute(bm, seq, 1)
    assert seq.block_table == [0, 1]
    assert bm.num_free_blocks == 2


def test_allocate_together_is_all_or_nothing():
    bm = BlockSpaceManager(num_blocks=5, block_size=4)
    a, b = make_seq(3), make_seq(6, first=100)
    compute(bm, a, 3)  # block 0 (1 slot left)
    compute(bm, b, 6)  # blocks 1, 2
    assert not bm.allocate_together([a, b], [9, 8])  # 2 + 2 more blocks, 2 free: nobody grows
    assert (a.block_table, b.block_table, bm.num_free_blocks) == ([0], [1, 2], 2)
    assert bm.allocate_together([a, b], [5, 2])  # 1 + 1 more blocks (b's 2 tokens fit block 2)
    assert (a.block_table, b.block_table, bm.num_free_blocks) == ([0, 3], [1, 2], 1)


def test_can_allocate_respects_free_count_and_watermark():
    bm = BlockSpaceManager(num_blocks=10, block_size=4, watermark=0.2)
    assert bm.watermark_blocks == 2
    big = make_seq(36)  # 9 blocks: fits, but eats into the 2 reserved ones
    assert bm.can_allocate(big, 36)
    assert not bm.can_allocate(big, 36, watermark=True)
    assert bm.can_allocate(big, 32, watermark=True)  # 8 blocks leave exactly the reserve
    assert not bm.can_allocate(make_seq(44), 44)


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockSpaceManager(num_blocks=8, block_size=4)
    a = make_seq(10)
    compute(bm, a, 10)  # blocks 0, 1 full; block 2 partial
    b = make_seq(10)  # same content
    hits = bm.lookup_prefix(b)
    assert hits == [0, 1]
    assert bm.can_allocate(b, 2, hits)
    bm.allocate(b, 2, hits)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [1, 1, 0]
    assert 0 not in bm.free_pool and 2 in bm.free_pool


def test_full_prefix_hit_leaves_the_last_token_to_compute():
    bm = BlockSpaceManager(num_blocks=8, block_size=4)
    a = make_seq(8)
    compute(bm, a, 8)
    b = make_seq(8)
    assert bm.lookup_prefix(b) == [0]  # block 1 would leave nothing to compute


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockSpaceManager(num_blocks=3, block_size=4)
    a = make_seq(5)
    compute(bm, a, 5)  # blocks 0 (full, cached) and 1
    bm.free(a)
    assert list(bm.free_pool) == [2, 1, 0]
    again = make_seq(5)
    hits = bm.lookup_prefix(again)
    assert hits == [0]
    bm.allocate(again, 1, hits)  # the cached block leaves the pool, the new one is the LRU block 2
    assert again.block_table == [0, 2]
    bm.free(again)
    other = make_seq(12, first=50)  # takes every block: the cached content is evicted
    compute(bm, other, 12)
    assert other.block_table == [1, 2, 0]
    assert bm.lookup_prefix(make_seq(5)) == []


def test_hit_blocks_in_the_free_pool_count_against_free_space():
    bm = BlockSpaceManager(num_blocks=3, block_size=4)
    a = make_seq(9)
    compute(bm, a, 9)
    bm.free(a)
    b = make_seq(9)
    hits = bm.lookup_prefix(b)
    assert hits == [0, 1]
    assert bm.can_allocate(b, 1, hits)  # 2 hits + 1 new = all 3 blocks
    assert not bm.can_allocate(b, 5, hits)


@pytest.mark.parametrize(
    "other",
    [
        dict(speaker_key=b"another speaker"),
        dict(text=True),
        dict(codebook=3),
    ],
    ids=["speaker", "text-audio-mask", "one-codebook"],
)
def test_prefix_key_covers_speaker_mask_and_every_codebook(other):
    bm = BlockSpaceManager(num_blocks=8, block_size=4)
    a = make_seq(9)
    compute(bm, a, 9)
    b = make_seq(9, speaker_key=other.get("speaker_key", b""))
    if other.get("text"):
        b.is_text[1] = True
    if "codebook" in other:
        q = other["codebook"]
        b.tokens[2] = tuple(t + (q == i) for i, t in enumerate(b.tokens[2]))
    assert bm.lookup_prefix(b) == []
    assert bm.lookup_prefix(make_seq(9)) == [0, 1]


def test_prefix_caching_off_never_hits():
    bm = BlockSpaceManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(9)
    compute(bm, a, 9)
    assert bm.lookup_prefix(make_seq(9)) == []
    assert bm.cached == {}


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockSpaceManager(num_blocks=0, block_size=4)
