from __future__ import annotations

import pytest

from engine.block_manager import BlockManager


def test_allocate_grow_free_roundtrip():
    bm = BlockManager(num_blocks=4, block_size=4)
    table, cached = bm.allocate(list(range(6)), 6)
    assert len(table) == 2 and cached == 0 and bm.num_free_blocks == 2
    assert bm.grow(table, 12) and len(table) == 3
    assert not bm.grow(table, 24) and len(table) == 3  # refused, unchanged
    bm.free(table)
    bm.check_all_free()


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate(list(range(13)), 13) is None
    assert bm.num_free_blocks == 3


def test_prefix_blocks_are_shared_and_revived():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    first, _ = bm.allocate(tokens, 10)
    bm.register_full_blocks(first, tokens, 10, 0)
    second, cached = bm.allocate(tokens[:8] + [99, 98], 10)
    assert cached == 8 and second[:2] == first[:2] and second[2] != first[2]
    assert bm.blocks[first[0]].ref_count == 2
    bm.free(first)
    bm.free(second)
    third, cached = bm.allocate(tokens[:8] + [7], 9)  # freed blocks keep their hash until reused
    assert cached == 8
    bm.free(third)
    bm.check_all_free()


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    table, _ = bm.allocate(a, 9)
    bm.register_full_blocks(table, a, 9, 0)
    other, cached = bm.allocate([0, 2, 3, 4, 5, 6, 7, 8, 9], 9)  # same second block, different first
    assert cached == 0
    bm.free(table)
    bm.free(other)


def test_double_free_is_an_error():
    bm = BlockManager(num_blocks=2, block_size=4)
    table, _ = bm.allocate([1, 2], 2)
    copy = list(table)
    bm.free(table)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(copy)
